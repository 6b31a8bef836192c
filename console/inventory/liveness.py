"""The liveness loop: nodes whose heartbeats stopped become ``degraded``, then ``lost`` -- but
never because the console itself could not hear them.

A heartbeat is missed either because the node is gone or because the console could not take
it (its server stalled, restarted, lost its database; #44: a console stalled by slow clients
had every healthy node marked ``lost`` within 35 s). The nodes' silence alone cannot tell the
two apart, so each turn of the loop (:func:`liveness_check`, the beat job every 10 s) first
asks whether the console could hear:

* it probes the console's own listener, ``LIVENESS_PROBE_URL`` + ``/healthz`` (the address the
  agents beat to, through the same TLS terminator and server), within
  ``LIVENESS_PROBE_TIMEOUT_S``; a probe that fails means the agents' beats fail too: the
  console is *blind*, and the loop judges nobody this turn;
* it compares the time with its own last turn: a gap longer than a node's lost deadline
  (``HEARTBEAT_INTERVAL_S`` x (``HEARTBEAT_MISSED_LIMIT`` + 0.5)) means nobody was watching
  (the worker, beat or database was down): the gap is a blind window too.

The end of the last blind window is kept in :class:`~console.inventory.models.LivenessWatch`;
a node whose last beat is older than it is not judged until ``HEARTBEAT_OUTAGE_GRACE_S`` after
it (long enough for agents that backed off while the console was unreachable to beat again).
A node that stays silent after that is marked as before, directly ``lost`` when it missed
enough beats. Without ``LIVENESS_PROBE_URL`` only the gap rule applies (and the loop logs
``liveness_unprobed`` once per process). A probe that fails while heartbeats still arrive is
wrong (its URL or CA), not a blind console: the loop judges as usual and logs
``liveness_probe_wrong`` (an error) each turn.
"""

from __future__ import annotations

import logging
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.inventory.models import LivenessWatch
from console.inventory.services import HEARTBEAT_GRACE_INTERVALS, node_mark_missing

logger = logging.getLogger(__name__)
_warned_unprobed = False


@dataclass(frozen=True)
class LivenessReport:
    """One turn of the loop: what changed, and whether the console was blind."""

    changed: dict[str, list[int]]
    #: The console could not hear heartbeats this turn (its probe failed): nobody was judged.
    blind: bool
    #: Why the console was taken to be blind this turn ("" when it was not).
    reason: str
    #: End of the last blind window (nodes silent across it have the grace after it).
    blind_until: datetime | None


def console_probe(url: str, *, ca: str = "", timeout: float = 5.0) -> str:
    """GET ``url`` + ``/healthz`` as an agent would reach the console: "" when it answered 200
    within ``timeout`` seconds, else what went wrong (a status, a timeout, a refusal)."""
    context = ssl.create_default_context(cafile=ca or None) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(  # noqa: S310 - an http(s) URL checked at start-up
            f"{url}/healthz", timeout=timeout, context=context
        ) as response:
            return "" if response.status == 200 else f"answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{type(reason).__name__}: {reason}"[:200]


def _heard_since(moment: datetime) -> bool:
    """Whether some node's heartbeat was recorded after ``moment``."""
    from console.inventory.models import Node

    return Node.objects.filter(last_heartbeat_at__gt=moment).exists()


def lost_deadline_s() -> float:
    """How long a node may be silent before it is ``lost`` (the loop's own gap limit too)."""
    return settings.HEARTBEAT_INTERVAL_S * (
        settings.HEARTBEAT_MISSED_LIMIT + HEARTBEAT_GRACE_INTERVALS
    )


def liveness_check(*, now: datetime | None = None) -> LivenessReport:
    """One turn of the liveness loop (see the module docstring): probe the console, record a
    blind window when it could not hear (or the loop had stopped), then judge the nodes with
    that window's grace. Called by the beat job ``orchestrator.inventory.mark_missing`` and
    ``pdbridge console node_mark_missing``; ``now`` is injectable for tests (the probe, when
    configured, still happens at the real time)."""
    global _warned_unprobed
    failure = ""
    if settings.LIVENESS_PROBE_URL:
        failure = console_probe(
            settings.LIVENESS_PROBE_URL,
            ca=settings.LIVENESS_PROBE_CA,
            timeout=settings.LIVENESS_PROBE_TIMEOUT_S,
        )
    elif not _warned_unprobed:
        _warned_unprobed = True
        logger.warning("liveness_unprobed", extra={"setting": "PDBRIDGE_LIVENESS_PROBE_URL"})
    # After the probe: a turn that waited on a stalled console judges at the time it resumes.
    now = now or timezone.now()
    with transaction.atomic():
        watch, _ = LivenessWatch.objects.select_for_update().get_or_create(pk=1)
        gap = (now - watch.checked_at).total_seconds() if watch.checked_at else 0.0
        probe_wrong = bool(
            failure and watch.blind_since is not None and _heard_since(watch.blind_since)
        )
        if probe_wrong:
            # Beats were recorded while the probe failed, so the console hears: the probe
            # itself is wrong (its URL or CA). Never blind on its word -- a wrong setting must
            # not stop nodes from ever being lost -- and no grace from its false window (it
            # stays open, so each turn sees this at once).
            logger.error(
                "liveness_probe_wrong",
                extra={"url": settings.LIVENESS_PROBE_URL, "reason": failure},
            )
            watch.blind_until = None
            watch.blind_reason = f"probe wrong: {failure}"[:300]
        elif failure:
            if watch.blind_since is None:
                watch.blind_since = now
                logger.warning("console_blind", extra={"reason": failure, "since": now})
            watch.blind_until = now
            watch.blind_reason = f"probe of {settings.LIVENESS_PROBE_URL}/healthz: {failure}"[:300]
        else:
            if watch.blind_since is not None:
                logger.warning(
                    "console_hears_again",
                    extra={
                        "blind_since": watch.blind_since,
                        "blind_s": round((now - watch.blind_since).total_seconds(), 1),
                        "grace_until": now + timedelta(seconds=settings.HEARTBEAT_OUTAGE_GRACE_S),
                    },
                )
                watch.blind_since = None
                watch.blind_until = now
            if gap > lost_deadline_s():
                # Nobody watched; whether the console heard meanwhile is unknown: a window.
                logger.warning(
                    "liveness_gap", extra={"gap_s": round(gap, 1), "since": watch.checked_at}
                )
                watch.blind_until = now
                watch.blind_reason = f"the liveness loop did not run for {gap:.0f} s"
        if watch.checked_at is None or now > watch.checked_at:
            watch.checked_at = now
        watch.save()
        changed = node_mark_missing(now=now, blind_until=watch.blind_until)
    return LivenessReport(
        changed=changed,
        blind=bool(failure) and not probe_wrong,
        reason=watch.blind_reason if failure else "",
        blind_until=watch.blind_until,
    )
