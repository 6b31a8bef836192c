"""``pdbridge.netns``: the two namespace sites of ``pdbridge run --netns`` and the deploy-flow
tests — one address per site, the console address reachable from both, the sites joined only
by the tbf-shaped WAN veth (a cut separates them and nothing else), teardown leaves nothing;
and the clear errors of ``pdbridge run --netns`` without root or without iproute2. With
``remote_sites=2`` (``pdbridge run --remote-sites 2 --netns``) each remote site has its own
shaped WAN veth to the local site: cutting one leaves the other."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdbridge import netns, run
from tests.netns import require_netns
from tests.support import deadline_in, subprocess_env, unavailable

ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""

DIAL = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as conn:
        print(conn.recv(64).decode())
except OSError as exc:
    print(f"error {exc!r}")
"""


def _listen(sites: netns.NamespaceSites, site: str) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-c", ECHO, sites.site(site).address]
    proc = subprocess.Popen(sites.wrap(site, argv), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _dial(sites: netns.NamespaceSites, where: str | None, address: str, port: int) -> str:
    argv = [sys.executable, "-c", DIAL, address, str(port)]
    done = subprocess.run(
        sites.wrap(where, argv) if where else argv,
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def _dial_until(sites: netns.NamespaceSites, where: str, address: str, port: int) -> str:
    deadline = deadline_in(20)
    while (answer := _dial(sites, where, address, port)).startswith("error"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.5)
    return answer


@pytest.mark.netns
def test_sites_reach_the_console_and_each_other_only_over_the_wan():
    require_netns()
    with netns.namespace_sites(rate_mbit=50) as sites:
        local, remote = sites.local, sites.remote
        server, port = _listen(sites, "local")
        try:
            # The root namespace (console side) dials the site address; the site sees the
            # console's address as the peer.
            assert _dial(sites, None, local.address, port) == sites.console_address
            # The remote site dials the same address and arrives over the WAN.
            assert _dial(sites, "remote", local.address, port) == remote.address

            sites.set_wan(False)
            assert sites.wan_up() is False
            assert _dial(sites, "remote", local.address, port).startswith("error")
            assert _dial(sites, None, local.address, port) == sites.console_address

            sites.set_wan(True)  # the kernel puts the peer route back with the link
            assert sites.wan_up() is True
            # (A neighbour entry that failed during the cut is resolved again on next use.)
            assert _dial_until(sites, "remote", local.address, port) == remote.address
        finally:
            server.kill()
            server.wait()
        qdisc = subprocess.run(
            ["ip", "netns", "exec", remote.namespace, "tc", "qdisc", "show", "dev", remote.wan],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc
        assert "50Mbit" in qdisc
        assert len({local.namespace, remote.namespace}) == 2
        assert local.namespace.startswith(f"{netns.default_prefix()}-local-")
        assert all(len(n) <= 15 for n in (local.mgmt, local.mgmt_root, local.wan))
        assert sorted(sites.exists()) == sorted(
            [local.namespace, remote.namespace, local.mgmt_root, remote.mgmt_root]
        )
    assert sites.exists() == []


@pytest.mark.netns
def test_two_remote_sites_each_reach_the_local_site_over_their_own_wan(tmp_path):
    require_netns()
    record = tmp_path / "netns.json"
    with netns.namespace_sites(rate_mbit=50, remote_sites=2) as sites:
        local, remote, b = sites.local, sites.remote, sites.site("remote-b")
        sites.record(record)
        server, port = _listen(sites, "local")
        try:
            assert _dial(sites, "remote", local.address, port) == remote.address
            assert _dial(sites, "remote-b", local.address, port) == b.address
            # The remote sites do not reach each other (no forwarding anywhere).
            assert _dial(sites, "remote", b.address, port).startswith("error")

            sites.set_wan(False, "remote")
            assert (sites.wan_up("remote"), sites.wan_up("remote-b")) == (False, True)
            assert _dial(sites, "remote", local.address, port).startswith("error")
            assert _dial(sites, "remote-b", local.address, port) == b.address

            sites.set_wan(True, "remote")
            assert _dial_until(sites, "remote", local.address, port) == remote.address
        finally:
            server.kill()
            server.wait()
        for site, dev in ((b, b.wan), (local, sites.local_end(b))):
            qdisc = subprocess.run(
                ["ip", "netns", "exec", site.namespace, "tc", "qdisc", "show", "dev", dev],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert "50Mbit" in qdisc, dev
        assert (
            b.namespace == f"{netns.default_prefix()}-remote-b-{local.namespace.rsplit('-', 1)[1]}"
        )
        assert [s.name for s in sites.all] == ["local", "remote", "remote-b"]
        assert len(set(sites.addresses)) == 4
        assert all(len(n) <= 15 for n in (b.mgmt, b.mgmt_root, b.wan, b.wan_peer))
        present = sites.exists()
        assert len(present) == 6  # three namespaces, three root-side veth ends
        # A killed run's record names every remote site.
        assert sorted(netns.remove_recorded(record)) == sorted(present)
    assert sites.exists() == []


def test_remote_sites_are_one_to_three():
    assert netns.remote_site_names(3) == ("remote", "remote-b", "remote-c")
    with pytest.raises(ValueError, match="remote sites: 1 to 3, got 4"):
        netns.remote_site_names(4)


@pytest.mark.netns
def test_two_runs_get_distinct_names_and_addresses_and_a_killed_run_is_cleaned_up(tmp_path):
    require_netns()
    record = tmp_path / "netns.json"
    with netns.namespace_sites() as first:
        second = netns.create()
        try:
            assert first.local.namespace != second.local.namespace
            assert not set(first.addresses) & set(second.addresses)
            second.record(record)
            present = second.exists()
        finally:
            # As if the run that made ``second`` had been killed: only its record is left.
            removed = netns.remove_recorded(record)
        assert sorted(removed) == sorted(present)
        assert len(present) == 4  # two namespaces, two root-side veth ends
        assert second.exists() == []
        assert not record.exists()
        assert first.exists()  # the other run's sites are untouched
    assert netns.remove_recorded(record) == []  # no record: nothing to do


@pytest.mark.netns
def test_a_bad_prefix_is_refused_naming_it():
    require_netns()  # the prefix is checked after root and iproute2
    with pytest.raises(netns.NetnsError, match="prefix"):
        netns.create(prefix="Bad-Prefix!")


def _run_netns(tmp_path: Path, argv_prefix: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*argv_prefix, sys.executable, "-m", "pdbridge.cli", "run", "--netns",
         "--var-dir", str(tmp_path / "var")],
        capture_output=True, text=True, timeout=120, check=False, env=subprocess_env(**env),
    )  # fmt: skip


def test_run_netns_without_root_says_so(tmp_path):
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            unavailable("setpriv (util-linux) is needed to drop root for this check")
        tmp_path.chmod(0o777)
        # Reading (only) through directories private to root: a checkout under a 0700
        # folder must still import as the unprivileged user.
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                  "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]  # fmt: skip
    else:
        prefix = []

    done = _run_netns(tmp_path, prefix, HOME=str(tmp_path))

    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed: network namespaces need root" in done.stdout


def test_run_netns_without_iproute2_says_so(tmp_path):
    if os.geteuid() != 0:
        unavailable("as non-root the root check answers first (the test above)")

    done = _run_netns(tmp_path, [], PATH=str(tmp_path))  # no ip, no tc on this PATH

    assert done.returncode == 1, done.stdout + done.stderr
    assert "ip and tc not found: install iproute2" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--netns", "--console-only"], "--netns: runs the testbed's sites"),
        (["--netns", "--check"], "--netns: runs the testbed's sites"),
        (["--netns", "--wan-mbit", "0"], "--wan-mbit: must be positive, got 0.0"),
        (["--wan-latency-ms", "-1"], "--wan-latency-ms: must be 0 or more"),
        (["--remote-sites", "0"], "--remote-sites: 1 to 3 remote prefill sites, got 0"),
        (["--remote-sites", "4"], "--remote-sites: 1 to 3 remote prefill sites, got 4"),
        (["--remote-sites", "2", "--console-only"], "--remote-sites: the testbed's sites"),
    ],
)
def test_run_option_errors_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        run.main(argv)

    assert exited.value.code == 2
    assert message in capsys.readouterr().err
