"""The prompt-length mix of synthetic load: a format the console stores in a drill's
``load_profile.mix`` (and validates there) and ``pdbridge loadgen --mix`` reads to draw prompt
lengths (``agents.loadgen``).

Text form: ``"weight:median:sigma,..."``, one truncated log-normal component per item.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Mostly chat-sized prompts plus a tail of long documents (the ones that go remote).
DEFAULT_MIX_TEXT = "0.7:96:0.6,0.3:640:0.5"


@dataclass(frozen=True)
class Component:
    """One log-normal component of the prompt-length mix: ``weight`` (relative), ``median``
    tokens and ``sigma`` (of the underlying normal)."""

    weight: float
    median: float
    sigma: float


def parse_mix(text: str) -> tuple[Component, ...]:
    """``"weight:median:sigma,..."`` -> components; ValueError naming ``--mix`` when malformed."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        try:
            weight, median, sigma = (float(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--mix: {item!r} is not weight:median:sigma") from None
        if weight <= 0 or median < 1 or sigma < 0:
            raise ValueError(f"--mix: {item!r} needs weight > 0, median >= 1, sigma >= 0")
        out.append(Component(weight, median, sigma))
    if not out:
        raise ValueError("--mix: at least one component")
    return tuple(out)
