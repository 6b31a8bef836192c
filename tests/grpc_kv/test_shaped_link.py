"""The link between two network namespaces over a veth pair shaped to 200 Mbit/s."""

import json
import sys

import pytest

from tests.netns import TwoSites, two_sites

pytestmark = [pytest.mark.netns, pytest.mark.slow]
RATE_MBIT = 200


@pytest.fixture(scope="module")
def sites():
    with two_sites(rate_mbit=RATE_MBIT) as net:
        server = net.popen(
            net.site_b,
            [
                sys.executable,
                "-m",
                "pdbridge.cli",
                "kv",
                "serve",
                "--bind",
                f"{net.ip_b}:0",
                "--insecure",
            ],
        )
        ready = json.loads(server.stdout.readline())
        yield net, f"{net.ip_b}:{ready['port']}"


def kv(net: TwoSites, *args: str) -> dict:
    result = net.run(
        net.site_a, [sys.executable, "-m", "pdbridge.cli", "kv", *args, "--insecure", "--json"]
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_probe_measures_the_shaped_rate(sites):
    net, target = sites

    result = kv(net, "probe", "--to", target, "--seconds", "2")

    assert 0.8 * RATE_MBIT <= result["mbit_s"] <= 1.1 * RATE_MBIT
    assert result["rtt_ms"] > 0


def test_uncompressed_transfer_fills_the_shaped_link(sites):
    net, target = sites

    result = kv(
        net,
        "loopback",
        "--to",
        target,
        "--compression",
        "none",
        "--blocks",
        "12",
        "--block-mb",
        "4",
    )

    assert result["ok"]
    assert result["bytes_raw"] == 12 * 4 * 2**20
    # The benchmark holds the 0.93 target on longer transfers; here begin/finish overhead
    # of a 1.5 s transfer is part of the figure.
    assert result["mbit_s"] >= 0.85 * RATE_MBIT
