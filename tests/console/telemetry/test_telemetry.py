from datetime import timedelta

import pytest
from django.utils import timezone

from console.telemetry import selectors, services
from console.telemetry.models import MetricSample
from tests.conftest import role_client

pytestmark = pytest.mark.django_db

T0 = timezone.now().replace(microsecond=0)


@pytest.fixture
def subject(make_user):
    # Any model instance can be a subject; a user keeps this test independent of other apps.
    return make_user("viewer", username="subject")


def test_series_is_time_ordered_windowed_and_label_filtered(subject):
    for minute, (value, path) in enumerate(
        [(1.0, "remote"), (2.0, "local"), (3.0, "remote"), (4.0, "remote")]
    ):
        services.sample_record(
            subject=subject,
            name="ttft_seconds",
            value=value,
            labels={"path": path},
            at=T0 + timedelta(minutes=minute),
        )

    remote = selectors.series(
        subject=subject,
        name="ttft_seconds",
        labels={"path": "remote"},
        since=T0 + timedelta(minutes=1),
    )

    assert [v for _, v in remote] == [3.0, 4.0]
    assert [v for _, v in selectors.series(subject=subject, name="ttft_seconds", limit=2)] == [
        3.0,
        4.0,
    ]
    assert selectors.latest(subject=subject, name="ttft_seconds")[1] == 4.0


def test_non_finite_values_are_dropped(subject):
    assert services.sample_record(subject=subject, name="x", value=float("nan")) is None
    assert (
        services.samples_record_many(
            subject=subject, values={"a": 1.0, "b": float("inf"), "c": 2.5}
        )
        == 2
    )
    assert MetricSample.objects.count() == 2


def test_summary_and_prune(subject):
    for minute in range(10):
        services.sample_record(
            subject=subject, name="util", value=minute / 10, at=T0 + timedelta(minutes=minute)
        )

    agg = selectors.summary(subject=subject, name="util", since=T0 + timedelta(minutes=5))
    deleted = services.samples_prune(
        older_than=timedelta(minutes=3), now=T0 + timedelta(minutes=10)
    )

    assert agg["count"] == 5
    assert agg["max"] == pytest.approx(0.9)
    assert deleted == 7
    assert MetricSample.objects.count() == 3


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 200), ("admin", 200)]
)
def test_samples_api_is_read_only_and_filterable(api_as, subject, role, expected):
    services.sample_record(subject=subject, name="link_measured_mbit_s", value=190.5, at=T0)
    api = role_client(api_as, role)

    response = api.get("/api/telemetry/samples/?name=link_measured_mbit_s")

    assert response.status_code == expected
    if expected == 200:
        assert response.json()["results"][0]["value"] == 190.5
        assert api.post("/api/telemetry/samples/", {}).status_code == (
            405 if role == "admin" else 403
        )
        assert api.get("/api/telemetry/samples/?since=not-a-date").status_code == 400
