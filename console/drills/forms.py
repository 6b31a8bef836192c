"""The drill form of the drills pages: every field of a drill definition, the criteria, the
target overrides and the synthetic load as one input each. The form only parses text into
values; ``console.drills.services`` (the API's services) judges them, and what it refuses
lands on the input it names (``criteria.max_failed_requests`` on that criterion's input)."""

from __future__ import annotations

import re
from typing import Any

from django import forms

from console.deployments.models import Deployment
from console.drills.choices import DrillKind
from console.drills.criteria import DEFAULTS as CRITERIA_DEFAULTS
from console.drills.criteria import SITE_DEFAULTS, criteria_defaults
from console.drills.models import Drill
from console.drills.services import LOAD_DEFAULTS

#: Target overrides (``Drill.targets``) shown as text inputs; empty means "derive it".
TARGET_TEXT = ("gateway_url", "decode_url", "model", "prefill_child")
#: Criteria whose default depends on whether the drill targets one site: a choice of
#: default / on / off, so that an untouched input follows the drill's kind of target.
SITE_DEPENDENT = tuple(SITE_DEFAULTS)
TRISTATE = [("", "default"), ("on", "on"), ("off", "off")]
#: Load profile keys shown as integer inputs (``rate`` is a number, ``mix`` text).
LOAD_INTEGERS = ("concurrency", "min_prompt_tokens", "max_prompt_tokens", "max_tokens", "seed")


def _label(key: str) -> str:
    return key.replace("_", " ")


class DrillForm(forms.Form):
    """A drill definition as posted by the create and edit pages."""

    name = forms.CharField(max_length=63, help_text="Lower-case letters, digits and dashes.")
    deployment = forms.ModelChoiceField(queryset=Deployment.objects.order_by("name"))
    kind = forms.ChoiceField(choices=DrillKind.choices)
    site = forms.CharField(
        required=False,
        max_length=63,
        label="target site",
        help_text="One prefill site of the deployment to fault (the others keep serving); "
        "empty: every prefill site.",
    )
    fault_s = forms.FloatField(label="fault (s)", initial=60, help_text="1 - 3600 s.")
    baseline_s = forms.FloatField(label="baseline window (s)", initial=30)
    after_s = forms.FloatField(label="after window (s)", initial=30)
    recover_timeout_s = forms.FloatField(label="recovery timeout (s)", initial=120)
    schedule = forms.CharField(
        required=False,
        max_length=100,
        help_text='Cron "minute hour day-of-month month day-of-week" (UTC); empty: on demand.',
    )

    def __init__(self, *args: Any, drill: Drill | None = None, **kwargs: Any) -> None:
        self.drill = drill
        if drill is not None and "initial" not in kwargs:
            kwargs["initial"] = self.initial_for(drill)
        super().__init__(*args, **kwargs)
        criteria = {
            **criteria_defaults(drill.site if drill else ""),
            **(drill.criteria if drill else {}),
        }
        for key, default in CRITERIA_DEFAULTS.items():
            name = f"criteria_{key}"
            if key in SITE_DEPENDENT:
                every, one = default, SITE_DEFAULTS[key]
                self.fields[name] = forms.ChoiceField(
                    required=False, choices=TRISTATE, label=_label(key),
                    help_text=f"Default: {'on' if every else 'off'} for every site, "
                    f"{'on' if one else 'off'} for one target site.",
                )  # fmt: skip
                stated = (drill.criteria or {}).get(key) if drill else None
                self.initial.setdefault(name, "" if stated is None else ("on" if stated else "off"))
                continue
            if key.startswith("require_"):
                self.fields[name] = forms.BooleanField(required=False, label=_label(key))
            elif key == "max_failed_requests":
                self.fields[name] = forms.IntegerField(label=_label(key))
            elif key == "max_fallback_requests":
                self.fields[name] = forms.IntegerField(
                    required=False, label=_label(key), help_text="Empty: not checked."
                )
            else:
                self.fields[name] = forms.FloatField(
                    required=False, label=f"{_label(key)}", help_text="Empty: not checked."
                )
            self.initial.setdefault(name, criteria[key] if drill else default)
        for key in TARGET_TEXT:
            self.fields[f"target_{key}"] = forms.CharField(
                required=False, label=_label(key), help_text="Empty: derived from the pools."
            )
        self.fields["target_verify_prompts"] = forms.CharField(
            required=False,
            label="verify prompts",
            help_text="Prompt lengths in tokens, comma-separated (empty: twice the threshold).",
        )
        for key in LOAD_INTEGERS:
            self.fields[f"load_{key}"] = forms.IntegerField(required=False, label=_label(key))
        self.fields["load_rate"] = forms.FloatField(
            required=False, label="rate (req/s)", help_text="Empty: closed loop."
        )
        self.fields["load_mix"] = forms.CharField(required=False, label="mix")
        for key, default in LOAD_DEFAULTS.items():
            if default is not None:
                self.fields[f"load_{key}"].widget.attrs["placeholder"] = str(default)

    @staticmethod
    def initial_for(drill: Drill) -> dict[str, Any]:
        initial: dict[str, Any] = {
            "name": drill.name,
            "deployment": drill.deployment_id,
            "kind": drill.kind,
            "site": drill.site,
            "fault_s": drill.fault_s,
            "baseline_s": drill.baseline_s,
            "after_s": drill.after_s,
            "recover_timeout_s": drill.recover_timeout_s,
            "schedule": drill.schedule,
        }
        for key, value in (drill.targets or {}).items():
            if key == "verify_prompts" and isinstance(value, list):
                value = ", ".join(map(str, value))
            initial[f"target_{key}"] = value
        for key, value in (drill.load_profile or {}).items():
            initial[f"load_{key}"] = value
        return initial

    #: Service keys -> this form's inputs, for messages naming one item of a JSON field.
    ALIASES: dict[str, str] = {
        **{f"criteria.{k}": f"criteria_{k}" for k in CRITERIA_DEFAULTS},
        **{f"targets.{k}": f"target_{k}" for k in (*TARGET_TEXT, "verify_prompts")},
        **{f"load_profile.{k}": f"load_{k}" for k in LOAD_DEFAULTS},
    }

    def service_fields(self) -> dict[str, Any]:
        """The keyword arguments of ``drill_create`` / ``drill_update`` (after ``is_valid``).
        Criteria keep the keys the drill states already plus those that differ from the
        defaults, so saving an untouched form changes nothing."""
        data = self.cleaned_data
        site = (data.get("site") or "").strip()
        stated = set(self.drill.criteria) if self.drill else set()
        criteria = {}
        for key, default in criteria_defaults(site).items():
            value = data.get(f"criteria_{key}")
            if key in SITE_DEPENDENT:
                # "on" / "off" ("default": "" leaves it to the drill's kind of target).
                if value and (key in stated or (value == "on") != default):
                    criteria[key] = value == "on"
            elif key in stated or value != default:
                criteria[key] = value
        targets: dict[str, Any] = {
            key: data[f"target_{key}"].strip()
            for key in TARGET_TEXT
            if data.get(f"target_{key}", "").strip()
        }
        prompts = data.get("target_verify_prompts", "").strip()
        if prompts:
            targets["verify_prompts"] = [
                int(p) if p.lstrip("-").isdigit() else p for p in re.split(r"[\s,]+", prompts) if p
            ]
        load: dict[str, Any] = {}
        for key in (*LOAD_INTEGERS, "rate"):
            if data.get(f"load_{key}") is not None:
                load[key] = data[f"load_{key}"]
        if data.get("load_mix", "").strip():
            load["mix"] = data["load_mix"].strip()
        return {
            "name": data["name"],
            "deployment": data["deployment"],
            "kind": data["kind"],
            "site": site,
            "fault_s": data["fault_s"],
            "baseline_s": data["baseline_s"],
            "after_s": data["after_s"],
            "recover_timeout_s": data["recover_timeout_s"],
            "schedule": data.get("schedule", ""),
            "criteria": criteria,
            "targets": targets,
            "load_profile": load,
        }

    def criteria_fields(self) -> list[forms.BoundField]:
        return [self[f"criteria_{k}"] for k in CRITERIA_DEFAULTS]

    def target_fields(self) -> list[forms.BoundField]:
        return [self[f"target_{k}"] for k in (*TARGET_TEXT, "verify_prompts")]

    def load_fields(self) -> list[forms.BoundField]:
        return [self[f"load_{k}"] for k in LOAD_DEFAULTS]
