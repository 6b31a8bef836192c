from django.db import models


class DrillKind(models.TextChoices):
    """What a drill breaks."""

    # The WAN path from the local (decode) site to the remote prefill site is severed.
    LINK_CUT = "link_cut", "Link cut"
    # The remote prefill engines are killed and held down, then come back (supervised restart).
    REMOTE_RESTART = "remote_restart", "Remote restart"


class ReportState(models.TextChoices):
    """A report's life: running -> passed | failed | aborted."""

    # The drill's run is in progress; figures are not in yet.
    RUNNING = "running", "Running"
    # Every criterion held.
    PASSED = "passed", "Passed"
    # The drill completed and at least one criterion did not hold.
    FAILED = "failed", "Failed"
    # The run itself failed or was canceled before it could measure.
    ABORTED = "aborted", "Aborted"


#: Workflow name per drill kind (keys of the orchestrator's workflow registry).
WORKFLOW = {DrillKind.LINK_CUT: "drill_link_cut", DrillKind.REMOTE_RESTART: "drill_remote_restart"}

#: The drill workflow's steps, in order (the orchestrator's module defines the same list; a test
#: keeps them equal, since the console never imports workflow code).
STEPS = [
    "start_load",
    "baseline",
    "inject_fault",
    "fault_window",
    "restore",
    "recovery",
    "collect_load",
    "verify",
    "report",
]
