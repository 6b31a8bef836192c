"""The alert rule form and the notification channel form of the alerts page. The forms only
turn posted text into typed values; ``console.alerts.services`` (the API's services) judges
them, and a refusal lands on the input it names (``console.core.forms.call_service``).

A webhook URL may carry a token, so the channel form never shows a stored one back: editing a
webhook channel starts with an empty target (left empty, the URL stays as it is), and a form
shown again after a refusal forgets the URL typed."""

from __future__ import annotations

from typing import Any

from django import forms

from console.alerts.choices import Aggregate, AlertLayer, AlertLevel, ChannelKind, Comparison
from console.alerts.defaults import DEPLOYMENT, LINK, NODE
from console.alerts.models import NotificationChannel
from console.alerts.services import channel_target_display

#: The subjects telemetry samples are about (``MetricSample.subject_type``); empty: any.
SUBJECT_TYPES = [
    ("", "any subject"),
    (NODE, "node (inventory.node)"),
    (LINK, "link (inventory.link)"),
    (DEPLOYMENT, "deployment (deployments.deployment)"),
]


class AlertRuleForm(forms.Form):
    """A new rule as posted by the rule form."""

    name = forms.CharField(
        max_length=63, help_text="Lower-case letters, digits and dashes (kv-queue-high)."
    )
    layer = forms.ChoiceField(choices=AlertLayer.choices, initial=AlertLayer.SERVICE)
    level = forms.ChoiceField(choices=AlertLevel.choices, initial=AlertLevel.WARNING)
    metric = forms.CharField(
        max_length=100, help_text="A telemetry metric name, base units (link_rtt_ms)."
    )
    subject_type = forms.ChoiceField(
        choices=SUBJECT_TYPES, required=False, label="subject", initial=""
    )
    aggregate = forms.ChoiceField(choices=Aggregate.choices, initial=Aggregate.AVG)
    comparison = forms.ChoiceField(choices=Comparison.choices, initial=Comparison.GT)
    threshold = forms.FloatField(help_text="In the metric's unit.")
    window_s = forms.IntegerField(label="window (s)", initial=300, help_text="From 10 s to 7 days.")
    summary = forms.CharField(
        max_length=300, required=False, help_text="What it means and what to do (the message)."
    )
    enabled = forms.BooleanField(required=False, initial=True, label="on")

    def service_fields(self) -> dict[str, Any]:
        return dict(self.cleaned_data)


class ChannelForm(forms.Form):
    """A channel as posted by the create and edit pages."""

    name = forms.CharField(max_length=63, help_text="Lower-case letters, digits and dashes.")
    kind = forms.ChoiceField(choices=ChannelKind.choices, initial=ChannelKind.WEBHOOK)
    target = forms.CharField(
        max_length=1000,
        required=False,
        widget=forms.TextInput(attrs={"autocomplete": "off", "size": 60}),
        help_text="Webhook: an http(s) URL (never shown back in full). E-mail: "
        "comma-separated addresses.",
    )
    min_level = forms.ChoiceField(
        choices=AlertLevel.choices, initial=AlertLevel.WARNING, label="from level"
    )
    send_resolved = forms.BooleanField(
        required=False, initial=True, label="also notify when an alert resolves"
    )
    enabled = forms.BooleanField(required=False, initial=True, label="on")

    def __init__(
        self, *args: Any, channel: NotificationChannel | None = None, **kwargs: Any
    ) -> None:
        self.channel = channel
        if channel is not None and "initial" not in kwargs:
            kwargs["initial"] = {
                "name": channel.name,
                "kind": channel.kind,
                "target": "" if channel.kind == ChannelKind.WEBHOOK else channel.target,
                "min_level": channel.min_level,
                "send_resolved": channel.send_resolved,
                "enabled": channel.enabled,
            }
        super().__init__(*args, **kwargs)
        if channel is not None and channel.kind == ChannelKind.WEBHOOK:
            shown = channel_target_display(channel.kind, channel.target)
            keep = f"Now {shown}. Leave empty to keep it; a new http(s) URL replaces it."
            self.fields["target"].help_text = keep

    def service_fields(self) -> dict[str, Any]:
        fields = dict(self.cleaned_data)
        keeps_url = (
            self.channel is not None
            and self.channel.kind == ChannelKind.WEBHOOK
            and fields["kind"] == ChannelKind.WEBHOOK
            and not fields["target"].strip()
        )
        if keeps_url:
            del fields["target"]
        else:
            fields["target"] = fields["target"].strip()
        return fields

    def forget_webhook_url(self) -> None:
        """Before showing a refused form again: drop a typed webhook URL (a secret)."""
        if self.is_bound and self.data.get(self.add_prefix("kind")) == ChannelKind.WEBHOOK:
            self.data = self.data.copy()
            self.data[self.add_prefix("target")] = ""
