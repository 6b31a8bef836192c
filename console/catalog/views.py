"""Model pages: the catalog, and one model's architecture summary with its KV size against
prompt length next to the dense model of the same layer count (``console.planner.kvsize``)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from console.catalog.models import ModelSpec
from console.catalog.selectors import model_kv_sizes
from console.core.charts import xy_chart
from console.core.pages import page_view, paginate
from console.planner.kvsize import ArchitectureError

# Prompt lengths of the KV-size chart: 256 tokens to 1M, doubling.
CHART_TOKENS = [256 * 2**i for i in range(13)]


@page_view
@require_GET
def model_list(request: HttpRequest) -> HttpResponse:
    """The model catalog, paginated."""
    models = ModelSpec.objects.all()
    return render(request, "catalog/model_list.html", {"page": paginate(request, models)})


def _layer_summary(arch: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for group in arch.get("layers", []):
        details = {k: v for k, v in group.items() if k not in {"kind", "count"}}
        rows.append({"kind": group.get("kind"), "count": group.get("count", 1), "details": details})
    return rows


@page_view
@require_GET
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One model: layer groups, KV size against prompt length next to its dense equivalent."""
    model = get_object_or_404(ModelSpec, pk=pk)
    chart, table, error = "", [], ""
    try:
        sizes = model_kv_sizes(model, CHART_TOKENS)
    except (ArchitectureError, KeyError, TypeError) as exc:
        error = f"architecture: {exc}"
    else:
        table = sizes["results"]
        tokens = [row["tokens"] for row in table]
        chart = xy_chart(
            title="KV cache per request against prompt length",
            lines={
                model.name: (tokens, [row["kv_bytes"] / 2**20 for row in table]),
                "dense equivalent (all full attention)": (
                    tokens,
                    [row["dense_equivalent_bytes"] / 2**20 for row in table],
                ),
            },
            x_title="prompt tokens",
            y_title="MiB",
            log_x=True,
            log_y=True,
        )
    deployments = model.deployments.all()
    context = {
        "model": model,
        "layers": _layer_summary(
            model.architecture if isinstance(model.architecture, dict) else {}
        ),
        "chart": chart,
        "table": [row for row in table if row["tokens"] in {1024, 8192, 32768, 131072, 1048576}],
        "error": error,
        "deployments": deployments,
    }
    return render(request, "catalog/model_detail.html", context)
