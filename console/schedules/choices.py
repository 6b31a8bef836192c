from django.db import models


class ApplicationOutcome(models.TextChoices):
    """What the beat did with one hour of one tidal schedule."""

    # The hour's plan was written to the deployment (a new config version) and scaled.
    APPLIED = "applied", "Applied"
    # The deployment already ran the hour's plan; nothing written.
    UNCHANGED = "unchanged", "Unchanged"
    # The kill switch was on: the schedule never overrides it (re-checked on the next tick).
    SKIPPED_KILL_SWITCH = "skipped_kill_switch", "Skipped: kill switch on"
    # The deployment is not active (draft, deploying, failed, retired): the deployment
    # workflow owns its settings until it is serving.
    SKIPPED_INACTIVE = "skipped_inactive", "Skipped: deployment not active"
    # A canary run was pending or running: the canary owns the remote share until it ends.
    SKIPPED_CANARY = "skipped_canary", "Skipped: canary in progress"
    # The plan could not be computed or written; ``error`` says why.
    FAILED = "failed", "Failed"


# Outcomes after which the hour is done (a later tick in the same hour does nothing).
FINAL_OUTCOMES = {ApplicationOutcome.APPLIED, ApplicationOutcome.UNCHANGED}


class ProposalState(models.TextChoices):
    """A rebalancing proposal's life: proposed -> applying -> applied | failed, or proposed
    -> dismissed | superseded."""

    # Waiting for an operator (or for auto-apply).
    PROPOSED = "proposed", "Proposed"
    # Approved: its ``rebalance`` run is moving the nodes (drain, relaunch, rejoin).
    APPLYING = "applying", "Applying"
    # Its run moved every node: the engines run in their new roles, the pools say so.
    APPLIED = "applied", "Applied"
    # Its run failed; the run's evidence says where, and which nodes stayed drained.
    FAILED = "failed", "Failed"
    # An operator declined it.
    DISMISSED = "dismissed", "Dismissed"
    # A newer proposal for the same deployment replaced it.
    SUPERSEDED = "superseded", "Superseded"
