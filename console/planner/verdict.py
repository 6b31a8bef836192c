"""Does cross-datacenter prefill pay off for this model and link at all? Pure Python.

The deployment guide's reverse check, made explicit:

1. **Dense model** (every layer full attention, known when the KV profile comes from an
   architecture): its KV grows with every layer, so a remote prefill instance emits tens of
   Gbit/s; stay with same-datacenter PD.
2. **Link**: find what compute alone would offload (the optimum with no link limit); the KV of
   those requests, ``Lambda x p x S_kv(l_long)``, must fit in the link's utilisation ceiling
   (default 70 %). If it does not, the link (not the remote pool) would decide the plan and
   the gateway would keep hitting its ceiling; stay with same-datacenter PD.
3. **Gain**: the best plan must beat the homogeneous baseline (same instance count, all local
   hardware) by at least ``min_gain`` (default 1.1x); a smaller gain does not pay for a second
   datacenter's operations.

``offload`` only when every check passes. The answer carries each check's numbers so that an
operator sees *why*, and (when the link check fails) what the plan inside the ceiling would
give. Called by ``console.planner.model.evaluate``; blocking, runs the grid twice more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from console.planner.model import Plan, Scenario

OFFLOAD = "offload"
STAY_LOCAL = "stay_local"


def verdict(s: Scenario, plan: Plan, homogeneous: dict[str, Any]) -> dict[str, Any]:
    """The decision, its first reason, and every check with its numbers."""
    from console.planner.model import capped_link, optimise, unlimited_link

    checks: dict[str, dict[str, Any]] = {}
    reasons: list[str] = []

    if s.dense is None:
        checks["dense"] = {"passed": None, "detail": "unknown (KV profile has no architecture)"}
    else:
        checks["dense"] = {"passed": not s.dense}
        if s.dense:
            reasons.append(
                "Dense model: every layer keeps full-attention KV, so a remote prefill instance "
                "emits tens of Gbit/s; stay with same-datacenter PD."
            )

    wanted, *_ = optimise(unlimited_link(s))
    usable = s.link_gbps * s.utilisation_ceiling
    link_ok = wanted.egress_gbps <= usable * (1 + 1e-9)
    link_check: dict[str, Any] = {
        "passed": link_ok,
        "demand_gbps": wanted.egress_gbps,
        "usable_gbps": usable,
        "threshold_tokens": wanted.threshold,
        "offload_share": wanted.offload_share,
    }
    if not link_ok:
        capped, *_ = optimise(capped_link(s))
        link_check["within_ceiling"] = {
            "threshold_tokens": capped.threshold,
            "lambda_max_rps": capped.lambda_max,
            "egress_gbps": capped.egress_gbps,
        }
        reasons.append(
            f"Thin link: the requests worth offloading (above {wanted.threshold:.0f} tokens, "
            f"{wanted.offload_share:.0%} of traffic) carry {wanted.egress_gbps:.1f} Gbit/s of KV, "
            f"more than {s.utilisation_ceiling:.0%} of the {s.link_gbps:g} Gbit/s link "
            f"({usable:.1f} Gbit/s); stay with same-datacenter PD."
        )
    checks["link"] = link_check

    base = homogeneous["lambda_max_rps"]
    gain = plan.lambda_max / base if base > 0 else (math.inf if plan.lambda_max > 0 else 0.0)
    gain_ok = gain >= s.min_gain
    checks["gain"] = {
        "passed": gain_ok,
        "gain": gain if math.isfinite(gain) else None,
        "min_gain": s.min_gain,
        "lambda_max_rps": plan.lambda_max,
        "homogeneous_rps": base,
    }
    if not gain_ok:
        reasons.append(
            f"Small gain: {plan.lambda_max:.2f} req/s against {base:.2f} req/s for "
            f"{homogeneous['instances']} local instances in same-datacenter PD ({gain:.2f}x, "
            f"below the {s.min_gain:g}x bar); stay with same-datacenter PD."
        )

    if reasons:
        return {"decision": STAY_LOCAL, "reason": reasons[0], "reasons": reasons, "checks": checks}
    reason = (
        f"Offload prompts above {plan.threshold:.0f} tokens ({plan.offload_share:.0%} of "
        f"traffic): {plan.lambda_max:.2f} req/s, {gain:.2f}x same-datacenter PD, using "
        f"{plan.egress_gbps:.1f} of {usable:.1f} usable Gbit/s."
    )
    return {"decision": OFFLOAD, "reason": reason, "reasons": [reason], "checks": checks}
