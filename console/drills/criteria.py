"""A drill's pass/fail criteria: defaults, validation and evaluation against measured figures.
Pure functions, called by the services (validation when a drill is written, evaluation when
its report step records the figures).

A drill of one prefill site (``Drill.site``) expects the gateway to fail that site's traffic
over to the other sites, not to fall back to local prefill: its defaults
(:data:`SITE_DEFAULTS`) drop ``require_fallback`` and ask for ``require_failover``."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

#: Criterion -> default. Limits of ``None`` are not checked.
DEFAULTS: dict[str, Any] = {
    "max_failed_requests": 0,  # client requests that did not get a complete answer
    "max_time_to_detect_s": None,  # fault -> first fallback answer
    "max_time_to_recover_s": 60.0,  # restore -> first remote answer
    "max_fallback_requests": None,  # fallback answers among requests sent during the fault
    "require_fallback": True,  # the fault window was served by the fallback path
    "require_failover": False,  # a one-site drill: other sites served remote answers meanwhile
    "require_breaker_open": True,  # the gateway's breaker ejected the remote site
    "require_recovery": True,  # traffic returned to the remote path after restore
    "require_verification": True,  # sample outputs match local runs token for token
}


#: What changes for a drill of one prefill site (the others keep serving remote).
SITE_DEFAULTS: dict[str, Any] = {"require_fallback": False, "require_failover": True}


def criteria_defaults(site: str = "") -> dict[str, Any]:
    """The defaults of a drill of every prefill site (``site`` empty) or of one."""
    return {**DEFAULTS, **(SITE_DEFAULTS if site else {})}


def validate_criteria(value: Any) -> dict[str, Any]:
    """``value`` checked key by key; ValidationError naming ``criteria.<key>``."""

    def fail(key: str, message: str) -> ValidationError:
        return ValidationError({"criteria": [f"criteria.{key}: {message}"]})

    if not isinstance(value, dict):
        raise ValidationError({"criteria": ["criteria: must be an object"]})
    for key, item in value.items():
        if key not in DEFAULTS:
            raise fail(key, f"unknown criterion; one of {', '.join(DEFAULTS)}")
        if key.startswith("require_"):
            if not isinstance(item, bool):
                raise fail(key, "must be true or false")
        elif key == "max_failed_requests":
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise fail(key, "must be an integer >= 0")
        elif key == "max_fallback_requests":
            if item is not None and (
                isinstance(item, bool) or not isinstance(item, int) or item < 0
            ):
                raise fail(key, "must be an integer >= 0 or null")
        elif item is not None and (
            isinstance(item, bool) or not isinstance(item, int | float) or item <= 0
        ):
            raise fail(key, "must be a positive number or null")
    return value


def merged_criteria(value: dict[str, Any], site: str = "") -> dict[str, Any]:
    return {**criteria_defaults(site), **value}


def evaluate(criteria: dict[str, Any], figures: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checked criterion: ``{"criterion", "limit", "value", "passed"}``."""
    rows: list[dict[str, Any]] = []

    def row(name: str, limit: Any, value: Any, passed: bool) -> None:
        rows.append({"criterion": name, "limit": limit, "value": value, "passed": bool(passed)})

    c = merged_criteria(criteria)
    failed = figures["failed_requests"]
    row("max_failed_requests", c["max_failed_requests"], failed, failed <= c["max_failed_requests"])
    detect, recover = figures["time_to_detect_s"], figures["time_to_recover_s"]
    if c["max_time_to_detect_s"] is not None:
        limit = c["max_time_to_detect_s"]
        row("max_time_to_detect_s", limit, detect, detect is not None and detect <= limit)
    if c["max_time_to_recover_s"] is not None:
        limit = c["max_time_to_recover_s"]
        row("max_time_to_recover_s", limit, recover, recover is not None and recover <= limit)
    served = figures["requests"].get("during", {})
    fallback = sum(n for key, n in served.items() if key.startswith("fallback/"))
    if c["max_fallback_requests"] is not None:
        limit = c["max_fallback_requests"]
        row("max_fallback_requests", limit, fallback, fallback <= limit)
    if c["require_fallback"]:
        remote_ok = served.get("remote/ok", 0)
        # Requests sent during the fault: some were served by fallback; any that still went
        # remote and succeeded are allowed only for a remote restart's first instant.
        row("require_fallback", True, {"fallback": fallback, "remote": remote_ok}, fallback > 0)
    if c["require_failover"]:
        sites = figures.get("sites") or {}
        faulted = sites.get("faulted") or ""
        during = (sites.get("served") or {}).get("during", {})
        others = {s: n for s, n in during.items() if s != faulted}
        # Remote answers from the sites that were not faulted, for requests sent meanwhile.
        row("require_failover", True, others, bool(faulted) and sum(others.values()) > 0)
    if c["require_breaker_open"]:
        ejections = figures["breaker"].get("ejections", 0)
        row("require_breaker_open", True, ejections, ejections >= 1)
    if c["require_recovery"]:
        row("require_recovery", True, recover, recover is not None)
    if c["require_verification"]:
        ok = bool(figures["verification"].get("ok"))
        row("require_verification", True, ok, ok)
    return rows


def failure_line(results: list[dict[str, Any]], verification: dict[str, Any]) -> str:
    """Why a judged drill failed, in one line ("" when every criterion passed): each failed
    criterion with its measured value and limit, the verification's own reason in words."""
    parts = []
    for r in results:
        if r["passed"]:
            continue
        if r["criterion"] == "require_verification":
            parts.append(
                "verification: " + (verification.get("reason") or "the samples did not pass")
            )
        elif r["limit"] is True:
            parts.append(f"{r['criterion']}: not met (measured {r['value']})")
        else:
            parts.append(f"{r['criterion']}: {r['value']} against a limit of {r['limit']}")
    return "; ".join(parts)
