"""Every write to drills and drill reports, and the drill's schedule in django-celery-beat.

Called by the API (operators), the beat task ``orchestrator.drills.run_scheduled`` and the drill
workflow (``drill_report_complete`` / ``drill_report_abort``). Blocking. Invalid input raises
Django's ``ValidationError`` naming the field (``load_profile.concurrency``, ``site`` ...), a drill
started while another drill runs on the same deployment raises ``Conflict`` (409).

A drill with a ``site`` faults that prefill site only (its WAN path, its engines): the other
prefill sites keep serving, and the report counts remote answers by site.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.core.services import audit_record
from console.deployments.choices import PoolRole
from console.deployments.models import Deployment
from console.drills.choices import STEPS, WORKFLOW, DrillKind, ReportState
from console.drills.criteria import evaluate, merged_criteria, validate_criteria
from console.drills.models import REPORT_FIGURES, Drill, DrillReport
from console.runs import services as run_services
from console.runs.choices import RUN_TERMINAL
from console.runs.models import WorkflowRun
from pdproto.loadmix import DEFAULT_MIX_TEXT, parse_mix

SCHEDULED_TASK = "orchestrator.drills.run_scheduled"

#: Synthetic load defaults (``pdbridge loadgen`` options).
LOAD_DEFAULTS: dict[str, Any] = {
    "concurrency": 4,
    "rate": None,
    "mix": DEFAULT_MIX_TEXT,
    "min_prompt_tokens": 16,
    "max_prompt_tokens": 2048,
    "max_tokens": 16,
    "seed": 0,
}
TARGET_KEYS = ("gateway_url", "decode_url", "model", "prefill_child", "verify_prompts")


def _fail(field: str, message: str) -> ValidationError:
    return ValidationError({field.split(".")[0]: [f"{field}: {message}"]})


def validate_load_profile(value: Any) -> dict[str, Any]:
    """The load profile merged over the defaults; ValidationError naming ``load_profile.<key>``."""
    if not isinstance(value, dict):
        raise _fail("load_profile", "must be an object")
    unknown = sorted(set(value) - set(LOAD_DEFAULTS))
    if unknown:
        raise _fail(f"load_profile.{unknown[0]}", f"unknown key; one of {', '.join(LOAD_DEFAULTS)}")
    for key in ("concurrency", "min_prompt_tokens", "max_prompt_tokens", "max_tokens", "seed"):
        item = value.get(key, LOAD_DEFAULTS[key])
        if (
            isinstance(item, bool)
            or not isinstance(item, int)
            or item < (0 if key == "seed" else 1)
        ):
            raise _fail(f"load_profile.{key}", "must be a positive integer")
    rate = value.get("rate")
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0
    ):
        raise _fail("load_profile.rate", "must be a positive number or null (closed loop)")
    if "mix" in value:
        try:
            parse_mix(str(value["mix"]))
        except ValueError as exc:
            raise _fail("load_profile.mix", str(exc).removeprefix("--mix: ")) from None
    merged = {**LOAD_DEFAULTS, **value}
    if not 2 <= merged["min_prompt_tokens"] <= merged["max_prompt_tokens"]:
        raise _fail("load_profile.min_prompt_tokens", "must be >= 2 and <= max_prompt_tokens")
    return value


def validate_targets(value: Any) -> dict[str, Any]:
    """Target overrides; ValidationError naming ``targets.<key>``."""
    if not isinstance(value, dict):
        raise _fail("targets", "must be an object")
    unknown = sorted(set(value) - set(TARGET_KEYS))
    if unknown:
        raise _fail(f"targets.{unknown[0]}", f"unknown key; one of {', '.join(TARGET_KEYS)}")
    for key in ("gateway_url", "decode_url"):
        if key in value and not str(value[key]).startswith(("http://", "https://")):
            raise _fail(f"targets.{key}", "an http:// or https:// base URL")
    for key in ("model", "prefill_child"):
        if key in value and (not isinstance(value[key], str) or not value[key]):
            raise _fail(f"targets.{key}", "a non-empty string")
    prompts = value.get("verify_prompts", [64])
    if (
        not isinstance(prompts, list)
        or not 1 <= len(prompts) <= 16
        or any(
            isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 32768 for n in prompts
        )
    ):
        raise _fail("targets.verify_prompts", "1 to 16 prompt lengths, each 2..32768")
    return value


def parse_cron(value: str) -> dict[str, str]:
    """``"m h dom mon dow"`` -> CrontabSchedule fields; ValidationError naming ``schedule``."""
    parts = value.split()
    if len(parts) != 5:
        raise _fail(
            "schedule", 'five fields expected: "minute hour day-of-month month day-of-week"'
        )
    allowed = set("0123456789*/,-")
    if any(not set(p) <= allowed for p in parts):
        raise _fail("schedule", "only digits and * / , - are allowed in each field")
    names = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    return dict(zip(names, parts, strict=True))


def _prefill_sites(deployment: Deployment) -> list[str]:
    """The deployment's remote prefill sites: sites of its prefill pools other than the
    decode pool's (a prefill pool at the decode site is local prefill, not a site to cut)."""
    pools = list(deployment.pools.select_related("site"))
    decode = {p.site.name for p in pools if p.role == PoolRole.DECODE}
    return sorted({p.site.name for p in pools if p.role == PoolRole.PREFILL} - decode)


def validate_site(site: Any, deployment: Deployment) -> str:
    """``site`` empty (every prefill site) or one of the deployment's prefill sites;
    ValidationError naming ``site``."""
    if site in (None, ""):
        return ""
    sites = _prefill_sites(deployment)
    if not isinstance(site, str) or site not in sites:
        known = ", ".join(sites) or "none"
        raise _fail(
            "site",
            f"{site!r} is not a prefill site of deployment {deployment.name} (one of: "
            f"{known}; empty: every prefill site)",
        )
    return site


def _normalise(fields: dict[str, Any], drill: Drill | None = None) -> dict[str, Any]:
    out = dict(fields)
    if "site" in out or ("deployment" in out and drill is not None and drill.site):
        deployment = out.get("deployment") or (drill.deployment if drill else None)
        site = out.get("site", drill.site if drill else "")
        if deployment is not None:
            out["site"] = validate_site(site, deployment)
    if "load_profile" in out:
        out["load_profile"] = validate_load_profile(out["load_profile"])
    if "criteria" in out:
        out["criteria"] = validate_criteria(out["criteria"])
    if "targets" in out:
        out["targets"] = validate_targets(out["targets"])
    if out.get("schedule"):
        out["schedule"] = " ".join(str(out["schedule"]).split())
        parse_cron(out["schedule"])
    return out


def _schedule_sync(drill: Drill) -> None:
    """Make the drill's PeriodicTask match its ``schedule`` (created, changed or removed)."""
    if not drill.schedule:
        if drill.periodic_task_id is not None:
            task = drill.periodic_task
            drill.periodic_task = None
            drill.save(update_fields=["periodic_task"])
            if task is not None:
                task.delete()
        return
    crontab, _ = CrontabSchedule.objects.get_or_create(**parse_cron(drill.schedule), timezone="UTC")
    task, _ = PeriodicTask.objects.update_or_create(
        name=f"drill:{drill.pk}",
        defaults={
            "task": SCHEDULED_TASK,
            "crontab": crontab,
            "interval": None,
            "args": json.dumps([drill.pk]),
            "enabled": True,
            "description": f"drill {drill.name} ({drill.kind})",
        },
    )
    if drill.periodic_task_id != task.pk:
        drill.periodic_task = task
        drill.save(update_fields=["periodic_task"])


@transaction.atomic
def drill_create(*, actor: Actor, **fields: Any) -> Drill:
    """Create a drill (and its periodic task when it has a schedule)."""
    fields = _normalise(fields)
    created_by = actor if actor is not None and actor.is_authenticated else None
    drill = audited_create(actor=actor, model=Drill, fields={**fields, "created_by": created_by})
    _schedule_sync(drill)
    return drill


@transaction.atomic
def drill_update(*, actor: Actor, drill: Drill, **fields: Any) -> Drill:
    """Change a drill; its schedule follows."""
    drill, _ = audited_update(actor=actor, instance=drill, fields=_normalise(fields, drill))
    _schedule_sync(drill)
    return drill


@transaction.atomic
def drill_delete(*, actor: Actor, drill: Drill) -> None:
    """Delete a drill and its schedule. Refused (409) while it has reports: they are the
    evidence that the fallback was exercised, and would go with it."""
    reports = DrillReport.objects.filter(drill=drill).count()
    if reports:
        raise Conflict(
            f"Drill {drill.name} has {reports} report(s); they are kept as evidence, so the "
            "drill cannot be deleted (clear its schedule to stop it running)."
        )
    task = drill.periodic_task
    audited_delete(actor=actor, instance=drill)
    if task is not None:
        task.delete()


def _sample_sizing(deployment: Deployment) -> dict[str, Any]:
    """The model's characters per token (1 when the catalog does not say: a byte tokenizer)
    and context length (None: unknown), for sizing verification prompts in the worker."""
    settings = deployment.model.engine_settings or {}
    per_token = settings.get("chars_per_token")
    max_len = settings.get("max_model_len")
    return {
        "chars_per_token": per_token
        if isinstance(per_token, int | float) and not isinstance(per_token, bool) and per_token > 0
        else 1,
        "max_model_len": max_len if isinstance(max_len, int) and max_len > 32 else None,
    }


def _remote_lengths(deployment: Deployment) -> list[int]:
    """The default verification sample: one prompt twice the remote threshold (so it goes
    remote even after the gateway re-tuned the threshold up a step or two), at least 64
    tokens, within the model's context when the catalog says it. Prompt lengths are
    characters: tokens times the model's ``chars_per_token`` (1 for a byte tokenizer)."""
    settings = deployment.model.engine_settings or {}
    tokens = max(deployment.remote_prefill_threshold_tokens * 2, 64)
    max_len = settings.get("max_model_len")
    if isinstance(max_len, int) and max_len > 32:
        tokens = min(tokens, max_len - 16)
    per_token = settings.get("chars_per_token")
    if isinstance(per_token, int | float) and not isinstance(per_token, bool) and per_token > 0:
        return [max(int(tokens * per_token), 2)]
    return [tokens]


def drill_params(drill: Drill) -> dict[str, Any]:
    """Everything the workflow needs, resolved now from the deployment's pools and the drill's
    overrides (the run is self-contained: later edits do not change a running drill)."""
    deployment = drill.deployment
    pools = list(deployment.pools.select_related("site").prefetch_related("nodes"))
    decode = next((p for p in pools if p.role == PoolRole.DECODE), None)
    prefill = [p for p in pools if p.role == PoolRole.PREFILL]
    if decode is None or not decode.nodes.exists():
        raise _fail("deployment", "the deployment has no decode pool with nodes")
    if not prefill:
        raise _fail("deployment", "the deployment has no remote prefill pool")
    prefill_sites = _prefill_sites(deployment)
    site = validate_site(drill.site, deployment)  # the pools may have changed since
    if site:
        prefill = [p for p in prefill if p.site.name == site]
    targets = drill.targets
    first = sorted(decode.nodes.all(), key=lambda n: n.hostname)[0]
    settings = {**(deployment.model.engine_settings or {}), **(decode.engine_settings or {})}
    host = settings.get("engine_host") or first.hostname
    gateway_scheme = "http" if django_settings.PDBRIDGE_CONTROLLER_INSECURE else "https"
    faults: list[dict[str, Any]] = []
    alternatives: list[list[dict[str, Any]]] = []
    if drill.kind == DrillKind.LINK_CUT:
        # The local site's agents cut their WAN path to each remote prefill site (the drill's
        # site only, when it names one); where they cannot (no route, interface or fault proxy
        # for that peer), the workflow cuts it from the other end: the prefill sites' agents
        # towards the decode site (the testbed's fault proxy sits in front of the WAN on the
        # remote agent).
        for node in decode.nodes.all():
            faults += [
                {
                    "agent": node.agent_address,
                    "node": node.hostname,
                    "kind": "link_cut",
                    "target": pool.site.name,
                }
                for pool in prefill
            ]
        remote_side = [
            {
                "agent": node.agent_address,
                "node": node.hostname,
                "kind": "link_cut",
                "target": decode.site.name,
            }
            for pool in prefill
            for node in pool.nodes.all()
        ]
        if remote_side:
            alternatives.append(remote_side)
    else:
        child = targets.get("prefill_child") or f"dep{deployment.pk}-prefill"
        faults = [
            {
                "agent": node.agent_address,
                "node": node.hostname,
                "kind": "engine_kill",
                "target": child,
            }
            for pool in prefill
            for node in pool.nodes.all()
        ]
        if not faults:
            raise _fail("deployment", "the remote prefill pools have no nodes to restart")
    return {
        "drill_id": drill.pk,
        "deployment_id": deployment.pk,
        "kind": drill.kind,
        "fault_s": drill.fault_s,
        "baseline_s": drill.baseline_s,
        "after_s": drill.after_s,
        "recover_timeout_s": drill.recover_timeout_s,
        "load": {**LOAD_DEFAULTS, **drill.load_profile},
        "criteria": merged_criteria(drill.criteria, site),
        # The faulted prefill site ("" : every one) and every prefill site of the deployment.
        "site": site,
        "prefill_sites": prefill_sites,
        # The gateway serves HTTPS unless the testbed runs plaintext (as agentops.gateway_url).
        "gateway_url": targets.get("gateway_url")
        or f"{gateway_scheme}://{host}:{int(settings.get('gateway_port', 8080))}",
        "decode_url": targets.get("decode_url")
        or f"http://{host}:{int(settings.get('port', 8000))}",
        "model": targets.get("model") or deployment.model.name,
        "verify_prompts": targets.get("verify_prompts") or _remote_lengths(deployment),
        # How a sample is sized against the threshold the gateway is applying when it is sent
        # (its re-tuner may have raised it well above the configured one).
        # Prompt lengths an operator gave are sent as given.
        "sample": None if targets.get("verify_prompts") else _sample_sizing(deployment),
        "faults": faults,
        # Tried in order when an agent of ``faults`` cannot act on its target.
        "fault_alternatives": alternatives,
    }


@transaction.atomic
def drill_run(*, actor: Actor, drill: Drill, trigger: str = "manual") -> DrillReport:
    """Start the drill now: a workflow run plus its report (state ``running``). Conflict when a
    drill is already running on the same deployment (two faults at once would blur both)."""
    Deployment.objects.select_for_update().get(pk=drill.deployment_id)  # one start at a time
    running = DrillReport.objects.filter(
        drill__deployment_id=drill.deployment_id, state=ReportState.RUNNING
    ).select_related("run", "drill")
    busy = None
    for report in running:
        if report.run is not None and report.run.state not in RUN_TERMINAL:
            busy = report
        else:  # its run was canceled or failed without reaching on_failure
            drill_report_abort(run_id=report.run_id or 0, error=run_ended_text(report))
    if busy is not None:
        raise Conflict(f"Drill {busy.drill.name} is running on this deployment (report {busy.pk}).")
    run = run_services.run_create(
        actor=actor,
        kind=WORKFLOW[DrillKind(drill.kind)],
        steps=list(STEPS),
        target=drill,
        params=drill_params(drill),
    )
    report = DrillReport.objects.create(
        drill=drill, run=run, kind=drill.kind, trigger=trigger, site=drill.site
    )
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="run",
        instance=drill,
        after={"run": run.pk, "report": report.pk, "trigger": trigger, "site": drill.site},
    )
    return report


@transaction.atomic
def drill_report_complete(*, run_id: int, figures: dict[str, Any]) -> DrillReport:
    """Record what the drill measured and judge it against the run's criteria (the workflow's
    ``report`` step; idempotent: a re-executed step writes the same figures again)."""
    report = DrillReport.objects.select_for_update().get(run_id=run_id)
    run = WorkflowRun.objects.get(pk=run_id)
    results = evaluate(run.params["criteria"], figures)
    for name in REPORT_FIGURES:
        setattr(report, name, figures[name])
    report.criteria_results = results
    report.state = ReportState.PASSED if all(r["passed"] for r in results) else ReportState.FAILED
    report.finished_at = timezone.now()
    report.error = ""
    report.save()
    return report


def run_ended_text(report: DrillReport) -> str:
    """Why a report whose run ended without reaching its report step has no verdict."""
    run = report.run
    if run is None:
        return "its run is gone"
    why = f": {run.error}" if run.error else ""
    return f"run #{run.pk} ended {run.state} before the report step{why}"


@transaction.atomic
def drill_report_abort(*, run_id: int, error: str) -> None:
    """The run failed or was canceled before its report: mark the report ``aborted``."""
    DrillReport.objects.filter(run_id=run_id, state=ReportState.RUNNING).update(
        state=ReportState.ABORTED, error=error[:4000], finished_at=timezone.now()
    )
