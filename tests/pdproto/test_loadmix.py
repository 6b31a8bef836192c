"""pdproto.loadmix: the prompt-length mix format the console validates and loadgen reads."""

from __future__ import annotations

import re

import pytest

from pdproto.loadmix import DEFAULT_MIX_TEXT, Component, parse_mix


def test_the_default_mix_text_parses_to_its_two_components():
    assert parse_mix(DEFAULT_MIX_TEXT) == (Component(0.7, 96, 0.6), Component(0.3, 640, 0.5))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:2", "--mix: '1:2' is not weight:median:sigma"),
        ("0:10:0.1", "--mix: '0:10:0.1' needs weight > 0, median >= 1, sigma >= 0"),
        ("1:10:-1", "--mix: '1:10:-1' needs weight > 0, median >= 1, sigma >= 0"),
    ],
)
def test_a_malformed_mix_is_refused_naming_the_item(text, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_mix(text)
