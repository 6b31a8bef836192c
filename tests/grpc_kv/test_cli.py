"""``pdbridge kv`` as operators and engines run it: separate processes."""

import asyncio
import json
import subprocess
import sys

import pytest

from grpc_kv.api import LinkOptions, TLSConfig, consume, open_transfer
from tests.grpc_kv.kvtest import FP, bf16_normal, make_header, run
from tests.support import subprocess_env


def kv(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "kv", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    result = kv("certs", "--out", str(out), "--node", "site-a", "--node", "site-b")
    assert result.returncode == 0, result.stderr
    return out


def test_certs_writes_a_ca_and_node_files(certs):
    names = sorted(p.name for p in certs.iterdir())

    assert names == [
        "ca-key.pem",
        "ca.pem",
        "site-a-key.pem",
        "site-a.pem",
        "site-b-key.pem",
        "site-b.pem",
    ]
    assert (certs / "site-a-key.pem").stat().st_mode & 0o777 == 0o600


def test_loopback_self_test_over_mtls_reports_verified_blocks(certs):
    result = kv("loopback", "--certs", str(certs), "--name", "site-a", "--blocks", "4", "--json")

    assert result.returncode == 0, result.stderr
    evidence = json.loads(result.stdout)
    assert evidence["ok"] is True
    assert evidence["bytes_raw"] == 4 * 4 * 2**20
    assert evidence["checksum_failures"] == 0


def test_loopback_over_the_bulk_data_path_says_so(certs):
    result = kv(
        "loopback", "--certs", str(certs), "--name", "site-a", "--blocks", "4",
        "--data-path", "bulk", "--json",
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    evidence = json.loads(result.stdout)
    assert evidence["ok"] is True
    assert evidence["data_path"] == "bulk"
    assert evidence["bytes_raw"] == 4 * 4 * 2**20


def test_commands_refuse_to_run_without_tls_or_an_explicit_insecure():
    result = kv("serve", "--bind", "127.0.0.1:0")

    assert result.returncode == 2
    assert "--insecure" in result.stderr


@pytest.mark.parametrize(("mode", "named"), [("999", "not an octal mode"), ("1777", "000..777")])
def test_serve_refuses_a_local_socket_mode_that_is_not_one(mode, named):
    result = kv("serve", "--insecure", "--local-socket", "/tmp/x.sock", "--local-socket-mode", mode)

    assert result.returncode == 2
    assert named in result.stderr


def test_sidecar_serves_an_engine_in_another_process_over_its_local_socket(certs, tmp_path):
    socket_path = tmp_path / "kv.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "kv", "serve", "--bind", "127.0.0.1:0",
         "--certs", str(certs), "--name", "site-b", "--allow-peer", "site-a",
         "--local-socket", str(socket_path)],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = json.loads(server.stdout.readline())["port"]
        data = bf16_normal(3 << 20)
        header = make_header({"k": 0, "v": 0})
        sender_tls = TLSConfig.from_dir(certs, "site-a", server_name="site-b")

        async def scenario():
            async def engine():
                async with consume(socket_path, header.transfer_id, 20.0, FP) as reader:
                    return reader.header, [s async for s in reader]

            consumer = asyncio.create_task(engine())
            await asyncio.sleep(0.2)
            options = LinkOptions(chunk_size_bytes=1 << 20, timeout_ms=20_000)
            async with open_transfer(f"127.0.0.1:{port}", header, options, sender_tls) as tx:
                await tx.send_layer("k", data)
                await tx.send_layer("v", data[::-1])
                await tx.finish()
            return await consumer

        got_header, segments = run(scenario())
    finally:
        server.terminate()
        server.wait(timeout=20)

    assert got_header.transfer_id == header.transfer_id
    assert b"".join(s.data for s in segments if s.layer == "k") == data
    assert b"".join(s.data for s in segments if s.layer == "v") == data[::-1]
    assert server.returncode == 0
