"""Link telemetry: every WAN link a serving deployment uses is probed on a schedule.

Step 2 of the deployment measures the link once; without later measurements the link and site
charts stayed empty, ``link-rate-low`` / ``link-rtt-high`` could never fire, and a TTFT
regression could not be told apart as "the link changed" vs "the configuration changed". The
beat task ``orchestrator.telemetry.probe_links`` calls :func:`probe_all` every
``LINK_PROBE_S`` seconds.

One round: for each deployment that is not draft or retired, each prefill site's link to the
decode site is probed once (the first prefill node of that site asks its agent to push random
blocks to the decode site's kv-link for ``LINK_PROBE_SECONDS``, the same measurement as step 2);
bandwidth, RTT and the ratio to the provisioned rate are recorded as samples of the link, and
the link's ``measured_*`` fields follow. The probe is skipped, and the skip recorded in the
answer, while a drill of that deployment runs (it would disturb the drill's figures and the
drill's link cut would fail it) and while the link already carries more than its utilisation
ceiling of KV (a probe then takes bandwidth from requests). ``Link.measured_mbit_s`` is the
rate the gateways score the site by (it is in the config snapshots): a probe that moved by more
than ``REFRESH_CHANGE`` from it is written through ``link_update`` (audited, new snapshots);
smaller drift updates only the RTT and ``measured_at`` (every figure is in the samples).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from console.deployments.choices import DeploymentState
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.drills.models import Drill
from console.inventory.models import Link
from console.inventory.services import link_update
from console.runs.choices import RunState
from console.runs.models import WorkflowRun
from console.telemetry import names
from console.telemetry.selectors import latest
from console.telemetry.services import samples_record_many
from orchestrator import agentops

log = logging.getLogger("pdbridge.orchestrator.linkprobe")

#: A relative change of the measured rate that is written as a change of the link (audited,
#: new config snapshots); below it the measurement is updated in place.
REFRESH_CHANGE = 0.2


def probe_seconds() -> float:
    return float(settings.LINK_PROBE_SECONDS)


def _drill_running(deployment: Deployment) -> bool:
    drills = Drill.objects.filter(deployment=deployment).values_list("pk", flat=True)
    drill_ids = [str(pk) for pk in drills]
    return WorkflowRun.objects.filter(
        target_type=Drill._meta.label_lower,
        target_id__in=drill_ids,
        state__in=[RunState.PENDING, RunState.RUNNING],
    ).exists()


def _busy(link: Link, now: datetime) -> float | None:
    """The link's utilisation when it is at or above its ceiling (the gateways' own figure,
    recorded by the gateway scrape in the last five minutes); None otherwise."""
    last = latest(subject=link, name=names.LINK_UTILIZATION)
    if last is None or now - last[0] > timedelta(minutes=5):
        return None
    return last[1] if last[1] >= link.utilization_ceiling else None


def record_samples(link: Link, result: dict[str, Any], now: datetime) -> None:
    """One probe's figures (``agentops.probe``'s answer) as samples of the link: the link
    page's charts and the link alert rules read them (this job and deployment step 2)."""
    mbit_s = float(result["mbit_s"])
    values = {
        names.LINK_MEASURED_MBIT_S: mbit_s,
        names.LINK_RTT_MS: float(result["rtt_ms"]),
        names.LINK_RATE_RATIO: mbit_s / link.provisioned_mbit_s,
    }
    loss = result.get("tcp_retransmit_ratio")
    if loss is not None and loss >= 0:  # -1: the agent could not read its TCP counters
        values[names.LINK_RETRANSMIT_RATIO] = float(loss)
    samples_record_many(
        subject=link,
        values=values,
        labels={"probe_bytes": result["bytes"], "from": result["from"]},
        at=now,
    )


def _record(link: Link, result: dict[str, Any], now: datetime) -> None:
    record_samples(link, result, now)
    mbit_s, rtt_ms = float(result["mbit_s"]), float(result["rtt_ms"])
    before = link.measured_mbit_s
    if before is None or abs(mbit_s - before) > REFRESH_CHANGE * max(before, 1e-9):
        link_update(actor=None, link=link, measured_mbit_s=mbit_s, rtt_ms=rtt_ms, measured_at=now)
    else:
        Link.objects.filter(pk=link.pk).update(rtt_ms=rtt_ms, measured_at=now)


def probe_deployment(
    deployment: Deployment, now: datetime | None = None, seen: set[int] | None = None
) -> dict[str, Any]:
    """Probe each of the deployment's prefill links once (not those in ``seen``: probed this
    round for another deployment). Returns ``{link id: outcome}`` where an outcome is the
    probe's figures, ``{"skipped": why}`` or ``{"error": what}``."""
    now = now or timezone.now()
    seen = set() if seen is None else seen
    outcomes: dict[str, Any] = {}
    if _drill_running(deployment):
        return {"deployment": {"skipped": "a drill of this deployment is running"}}
    config = build_config(deployment)
    decodes = agentops.targets(config, "decode")
    if not decodes:
        return outcomes
    decode = decodes[0]
    for target in agentops.targets(config, "prefill"):
        link = (
            Link.objects.filter(from_site__name=target.site, to_site__name=decode.site)
            .select_related("from_site", "to_site")
            .first()
        )
        if link is None or link.pk in seen:
            continue  # one probe per link and round, from the site's first prefill node
        seen.add(link.pk)
        key = str(link.pk)
        utilisation = _busy(link, now)
        if utilisation is not None:
            outcomes[key] = {"skipped": f"link busy: utilisation {utilisation:.2f}"}
            continue
        try:
            result = agentops.probe(
                target, decode.site, decode.kv_link_wan_address_for(target.site), probe_seconds()
            )
        except Exception as exc:  # a down peer is a gap in the chart and a log line
            log.warning("link probe %s failed: %s", link, exc)
            outcomes[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        _record(link, result, now)
        outcomes[key] = result
    return outcomes


def probe_all() -> dict[str, Any]:
    """Every serving deployment's links, probed once. Returns outcomes by deployment id."""
    live = Deployment.objects.exclude(state__in=[DeploymentState.DRAFT, DeploymentState.RETIRED])
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for deployment in live:
        try:
            out[str(deployment.pk)] = probe_deployment(deployment, seen=seen)
        except Exception as exc:  # one deployment's bad config must not stop the others
            log.exception("link probes of deployment %s failed", deployment.pk)
            out[str(deployment.pk)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out
