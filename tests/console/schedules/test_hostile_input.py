"""Never a 500 from the schedules and alerts endpoints: odd values get 4xx answers."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

HUGE = "9" * 30


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/api/tidal-schedules/{s}/what-if/", "just a string"),
        ("post", "/api/tidal-schedules/{s}/what-if/", [1, 2]),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"capacity": HUGE}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"capacity": [int(HUGE)] * 24}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"remote_prices": ["NaN"] * 24}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"remote_prices": [1e308] * 24}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"scenario": "x"}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"scenario": {"kv": {"model": HUGE}}}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"rtt_ms": "NaN"}),
        ("post", "/api/tidal-schedules/{s}/what-if/", {"gpus_per_instance": HUGE}),
        ("patch", "/api/tidal-schedules/{s}/", {"capacity": {"a": 1}}),
        ("patch", "/api/tidal-schedules/{s}/", {"timezone": "x" * 500}),
        ("patch", "/api/tidal-schedules/{s}/", {"rtt_ms": "Infinity"}),
        ("patch", "/api/tidal-schedules/{s}/", {"remote_site": HUGE}),
        ("get", "/api/tidal-applications/?since=yesterday", None),
        ("get", "/api/tidal-applications/?schedule=" + HUGE, None),
        ("get", "/api/rebalance-proposals/" + HUGE + "/", None),
        ("post", "/api/site-prices/", {"site": "{r}", "gpu_hour_prices": "cheap"}),
        ("post", "/api/site-prices/", {"site": "{r}", "gpu_hour_prices": [True] * 24}),
        (
            "post",
            "/api/site-prices/",
            {"site": "{r}", "gpu_hour_prices": [1] * 24, "kw_per_gpu": "NaN"},
        ),
        ("post", "/api/alert-rules/", {"name": "x", "threshold": "NaN", "metric": "m"}),
        ("post", "/api/alert-rules/", {"name": "x", "threshold": HUGE + "e999", "metric": "m"}),
        ("post", "/api/alert-rules/", {"name": "x", "window_s": HUGE, "metric": "m"}),
        ("post", "/api/alert-channels/", {"name": "x", "kind": "webhook", "target": "http://"}),
        ("post", "/api/alert-channels/", {"name": "x", "kind": "email", "target": ","}),
        ("get", "/api/alerts/?since=" + HUGE, None),
        ("get", "/api/alerts/?rule=abc", None),
    ],
)
def test_odd_input_is_a_4xx(tidal, api_as, method, path, body):
    api = api_as("admin")
    path = path.format(s=tidal.schedule.pk)
    if isinstance(body, dict):
        body = {k: (tidal.remote.pk if v == "{r}" else v) for k, v in body.items()}
    response = getattr(api, method)(path, body, format="json")
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
