from django.db import models


class AlertLevel(models.TextChoices):
    """How loud an alert is (channels subscribe from a minimum level up)."""

    # Worth knowing; no action expected now.
    INFO = "info", "Info"
    # Degraded or heading there; act within hours.
    WARNING = "warning", "Warning"
    # Users are or will shortly be affected; act now.
    CRITICAL = "critical", "Critical"


LEVEL_RANK = {AlertLevel.INFO: 0, AlertLevel.WARNING: 1, AlertLevel.CRITICAL: 2}


class AlertLayer(models.TextChoices):
    """The guide's metric layers."""

    # Accelerator use, memory.
    RESOURCE = "resource", "Resource"
    # WAN link: rate, retransmits, RTT, utilisation.
    LINK = "link", "Link"
    # TTFT, success rate, queue length.
    SERVICE = "service", "Service"
    # QPS, token throughput.
    BUSINESS = "business", "Business"


class AlertState(models.TextChoices):
    """An alert's life: firing -> resolved (a new breach later is a new alert)."""

    # The rule's condition holds for this subject.
    FIRING = "firing", "Firing"
    # The condition stopped holding; kept as history.
    RESOLVED = "resolved", "Resolved"


class Comparison(models.TextChoices):
    """How the aggregated value is compared with the threshold."""

    # Fires when the value is above the threshold.
    GT = "gt", ">"
    # Fires when the value is below the threshold.
    LT = "lt", "<"


class Aggregate(models.TextChoices):
    """How the samples in the window become one value (Prometheus *_over_time)."""

    # Mean of the window's samples.
    AVG = "avg", "avg"
    # Largest sample.
    MAX = "max", "max"
    # Smallest sample.
    MIN = "min", "min"
    # Most recent sample.
    LAST = "last", "last"


class ChannelKind(models.TextChoices):
    """Where a notification goes."""

    # HTTP POST of a JSON document to a URL.
    WEBHOOK = "webhook", "Webhook"
    # Django mail to a comma-separated list of addresses.
    EMAIL = "email", "E-mail"
