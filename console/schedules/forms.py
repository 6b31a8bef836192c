"""The tidal schedule form and the per-site price table form of the tidal pages. Hourly
values (capacity, demand, prices) are 24 inputs each; the scenario is the planner's JSON
body. The forms only parse text; ``console.schedules.services`` (the API's services) judges
the values, and a refusal such as ``capacity[5]: Must be an integer.`` marks that hour."""

from __future__ import annotations

import json
from typing import Any

from django import forms

from console.core.forms import hour_cells, hourly_blank, hourly_values
from console.deployments.models import Deployment
from console.inventory.models import Site
from console.planner.presets import preset_scenario
from console.schedules.models import SitePriceTable, TidalSchedule

#: The scenario a new schedule starts from (the planner's shipped case study).
START_PRESET = "prfaas-case-study"


#: The schedule's plain settings, in the form's order (the deployment is set once, at creation).
SETTINGS = (
    "remote_site",
    "local_site",
    "timezone",
    "ttft_limit_ms",
    "gpus_per_instance",
    "rtt_ms",
    "enabled",
    "rebalance_auto_apply",
)


class _Hourly(forms.Field):
    """Carries the messages about a 24-hour grid (the grid's inputs are ``<name>_<hour>``)."""

    widget = forms.HiddenInput

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, **kwargs)


class TidalScheduleForm(forms.Form):
    """A tidal schedule as posted by the create and edit pages."""

    deployment = forms.ModelChoiceField(queryset=Deployment.objects.order_by("name"))
    remote_site = forms.ModelChoiceField(
        queryset=Site.objects.order_by("name"), help_text="Where prefill moves when cheaper."
    )
    local_site = forms.ModelChoiceField(queryset=Site.objects.order_by("name"))
    timezone = forms.CharField(
        max_length=64, initial="UTC", help_text="IANA zone whose hours index prices and capacity."
    )
    ttft_limit_ms = forms.IntegerField(label="TTFT limit (ms)", initial=3000)
    gpus_per_instance = forms.IntegerField(label="GPUs per instance", initial=8)
    rtt_ms = forms.FloatField(label="WAN RTT (ms)", initial=0.0)
    enabled = forms.BooleanField(
        required=False, label="apply hourly (beat)", help_text="Off: what-if only."
    )
    rebalance_auto_apply = forms.BooleanField(
        required=False, label="apply rebalancing proposals at once"
    )
    scenario = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 14}),
        help_text="A planner evaluate body (docs/planner.md); remote.instances is set per hour.",
    )
    capacity = _Hourly(label="remote instances available")
    demand_rps = _Hourly(label="expected requests/s (optional)")

    def __init__(self, *args: Any, schedule: TidalSchedule | None = None, **kwargs: Any) -> None:
        self.schedule = schedule
        if schedule is not None and "initial" not in kwargs:
            kwargs["initial"] = {
                "deployment": schedule.deployment_id,
                "remote_site": schedule.remote_site_id,
                "local_site": schedule.local_site_id,
                "timezone": schedule.timezone,
                "ttft_limit_ms": schedule.ttft_limit_ms,
                "gpus_per_instance": schedule.gpus_per_instance,
                "rtt_ms": schedule.rtt_ms,
                "enabled": schedule.enabled,
                "rebalance_auto_apply": schedule.rebalance_auto_apply,
            }
        super().__init__(*args, **kwargs)
        if schedule is not None:
            # A schedule belongs to its deployment for good (the service ignores a change).
            self.fields["deployment"].disabled = True
        scenario = schedule.scenario if schedule is not None else preset_scenario(START_PRESET)
        self.initial.setdefault("scenario", json.dumps(scenario, indent=2))

    def clean_scenario(self) -> Any:
        text = self.cleaned_data["scenario"]
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"Not JSON: {exc.msg} (line {exc.lineno}).") from None

    def service_fields(self) -> dict[str, Any]:
        data = self.cleaned_data
        fields = {name: data[name] for name in (*SETTINGS, "scenario")}
        fields["capacity"] = hourly_values(self.data, "capacity", integer=True)
        fields["demand_rps"] = (
            []
            if hourly_blank(self.data, "demand_rps")
            else hourly_values(self.data, "demand_rps", integer=False)
        )
        if self.schedule is None:
            fields["deployment"] = data["deployment"]
        return fields

    def capacity_cells(self) -> list[dict[str, Any]]:
        current = self.schedule.capacity if self.schedule else [0] * 24
        return hour_cells(self, "capacity", current)

    def demand_cells(self) -> list[dict[str, Any]]:
        return hour_cells(self, "demand_rps", self.schedule.demand_rps if self.schedule else [])

    def setting_fields(self) -> list[forms.BoundField]:
        return [self[n] for n in ("deployment", *SETTINGS)]


class PriceTableForm(forms.Form):
    """One site's hourly price table (its inputs prefixed ``site<id>-``, one form per site
    on the prices page)."""

    gpu_hour_prices = _Hourly(label="price per GPU-hour")
    energy_prices_kwh = _Hourly(label="energy price per kWh (optional)")
    kw_per_gpu = forms.FloatField(
        label="kW per GPU", initial=0.0, help_text="Used with the energy prices."
    )

    def __init__(self, *args: Any, site: Site, table: SitePriceTable | None, **kwargs: Any) -> None:
        self.site, self.table = site, table
        kwargs.setdefault("prefix", f"site{site.pk}")
        if table is not None and "initial" not in kwargs:
            kwargs["initial"] = {"kw_per_gpu": table.kw_per_gpu}
        super().__init__(*args, **kwargs)

    def service_fields(self) -> dict[str, Any]:
        energy = self.add_prefix("energy_prices_kwh")
        return {
            "gpu_hour_prices": hourly_values(
                self.data, self.add_prefix("gpu_hour_prices"), integer=False
            ),
            "energy_prices_kwh": (
                []
                if hourly_blank(self.data, energy)
                else hourly_values(self.data, energy, integer=False)
            ),
            "kw_per_gpu": self.cleaned_data["kw_per_gpu"],
        }

    def price_cells(self) -> list[dict[str, Any]]:
        current = (
            self.table.gpu_hour_prices
            if self.table is not None
            else [float(self.site.gpu_hour_price)] * 24
        )
        return hour_cells(self, "gpu_hour_prices", current)

    def energy_cells(self) -> list[dict[str, Any]]:
        return hour_cells(
            self, "energy_prices_kwh", self.table.energy_prices_kwh if self.table else []
        )
