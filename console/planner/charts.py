"""Plotly charts of a planner answer, as HTML fragments for the planner page. Pure (no Django):
takes the dict ``model.evaluate`` returns. The page loads plotly.js once from
``/assets/plotly.min.js`` (served from the plotly package: no CDN), so the fragments carry
no script library."""

from __future__ import annotations

from typing import Any


def _html(fig: Any) -> str:
    return str(fig.to_html(full_html=False, include_plotlyjs=False, config={"responsive": True}))


def threshold_chart(result: dict[str, Any]) -> str:
    """Lambda_max (best split) against the threshold, with the two prefill capacities at that
    split: the optimum sits where they cross."""
    import plotly.graph_objects as go  # heavy import, only for pages that draw

    sweep = result["sweeps"]["threshold"]
    x = sweep["threshold_tokens"]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=sweep["lambda_max_rps"], name="Lambda_max (best split)"))
    fig.add_trace(
        go.Scatter(
            x=x,
            y=sweep["remote_capacity_rps"],
            name="remote prefill capacity",
            line={"dash": "dot"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=sweep["local_capacity_rps"], name="local prefill capacity", line={"dash": "dot"}
        )
    )
    optimum = result["optimum"]
    fig.add_vline(x=optimum["threshold_tokens"], line={"dash": "dash", "color": "grey"})
    top = max((v for v in sweep["lambda_max_rps"] if v is not None), default=1.0)
    fig.update_layout(
        title="Throughput against the offload threshold",
        xaxis_title="threshold t (tokens)",
        yaxis_title="requests/s",
        yaxis_range=[0, top * 1.6],
        height=380,
        margin={"l": 50, "r": 20, "t": 50, "b": 45},
        legend={"orientation": "h", "y": -0.25},
    )
    return _html(fig)


def split_chart(result: dict[str, Any]) -> str:
    """Best Lambda_max for each prefill/decode split of the local instances."""
    import plotly.graph_objects as go

    sweep = result["sweeps"]["split"]
    labels = [f"{p}/{d}" for p, d in zip(sweep["n_prefill"], sweep["n_decode"], strict=True)]
    fig = go.Figure(go.Bar(x=labels, y=sweep["lambda_max_rps"], name="Lambda_max"))
    fig.update_layout(
        title="Throughput per local split (prefill/decode)",
        xaxis_title="N_p / N_d",
        yaxis_title="requests/s",
        height=340,
        margin={"l": 50, "r": 20, "t": 50, "b": 45},
    )
    return _html(fig)
