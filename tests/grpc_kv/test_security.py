"""mTLS on the KV link: who gets in, who is refused, and certificate reload."""

import asyncio
import shutil
import time

import grpc
import pytest

from grpc_kv.api import (
    LinkOptions,
    PeerRefused,
    ReceiverOptions,
    ReceiverUnreachable,
    TLSConfig,
    TransferError,
    TransferRefused,
    TransferTimeout,
    create_node_cert,
    open_transfer,
)
from tests.grpc_kv.kvtest import make_header, receiver, run

FAST_FAIL = LinkOptions(timeout_ms=1500, rpc_timeout_ms=500)


def tls_for(pki, name, **kw):
    files = pki[name]
    return TLSConfig(
        ca_file=files.ca_file, cert_file=files.cert_file, key_file=files.key_file, **kw
    )


async def send_one(target, tls, options=FAST_FAIL):
    async with open_transfer(target, make_header({"l0": 0}), options, tls) as tx:
        await tx.send_layer("l0", b"secret kv" * 100)
        return await tx.finish()


def test_mutual_tls_with_an_allowed_peer_transfers(pki):
    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(tls=server_tls) as (_server, target):
            return await send_one(target, tls_for(pki, "site-a", server_name="site-b"))

    assert run(scenario()).bytes_raw == 900


def test_peer_not_on_the_allowlist_is_refused_and_counted(pki):
    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(tls=server_tls) as (server, target):
            with pytest.raises(TransferRefused) as err:
                await send_one(target, tls_for(pki, "intruder", server_name="site-b"))
            rejected = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
            )
            return err.value.code, rejected

    code, rejected = run(scenario())

    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert rejected == 1


def test_client_without_a_certificate_is_refused(pki):
    async def scenario():
        async with receiver(tls=tls_for(pki, "site-b")) as (_server, target):
            credentials = grpc.ssl_channel_credentials(
                root_certificates=pki["ca"].ca_file.read_bytes()
            )
            channel = grpc.aio.secure_channel(
                target, credentials, options=[("grpc.ssl_target_name_override", "site-b")]
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/pdbridge.kv.v1.KvLink/Ping")(b"", timeout=2)
            await channel.close(None)
            return err.value.code()

    assert run(scenario()) == grpc.StatusCode.UNAVAILABLE


def sender_tls(pki, tmp_path, case):
    """The sender's TLS for one refusal case (and what the receiver runs with)."""
    if case == "plaintext sender":
        return TLSConfig(insecure=True)
    if case == "sender from another CA":  # trusts site-b's CA, its own certificate is foreign
        return TLSConfig(
            ca_file=pki["site-a"].ca_file,
            cert_file=pki["foreign"].cert_file,
            key_file=pki["foreign"].key_file,
            server_name="site-b",
        )
    if case == "sender trusting another CA":
        return tls_for(pki, "foreign", server_name="site-b")
    if case == "expired sender certificate":
        expired = create_node_cert(pki["ca"], tmp_path, "site-a", days=0)
        return TLSConfig(
            ca_file=expired.ca_file,
            cert_file=expired.cert_file,
            key_file=expired.key_file,
            server_name="site-b",
        )
    if case == "wrong server name":
        return tls_for(pki, "site-a", server_name="not-site-b")
    if case == "not on the allowlist":
        return tls_for(pki, "intruder", server_name="site-b")
    raise AssertionError(case)


REFUSALS = {
    "plaintext sender": ("tls", "requires TLS; this sender is configured for plaintext"),
    "sender from another CA": ("tls", "refused this sender's certificate"),
    "sender trusting another CA": ("tls", "not trusted by this sender"),
    "expired sender certificate": ("tls", "refused this sender's certificate"),
    "wrong server name": ("tls", "names another host"),
    "not on the allowlist": ("not_allowed", "'intruder' is not on the allowlist"),
}


@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_handshake_or_peer_fails_at_once_naming_why(pki, tmp_path, case, data_path):
    """A certificate or protocol refusal is final: the sender fails within one round trip
    plus a second with the reason, instead of retrying it as UNAVAILABLE until its
    deadline (20 s here) and reporting a timeout."""
    options = LinkOptions(timeout_ms=20_000, rpc_timeout_ms=2000, data_path=data_path)

    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(ReceiverOptions(bulk=True), tls=server_tls) as (server, target):
            tls = sender_tls(pki, tmp_path, case)
            started = time.monotonic()
            with pytest.raises(PeerRefused) as err:
                await send_one(target, tls, options)
            elapsed = time.monotonic() - started
            received = server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")
            return err.value, elapsed, received

    error, elapsed, received = run(scenario())

    reason, words = REFUSALS[case]
    assert error.reason == reason
    assert words in str(error)
    assert elapsed < 1.5  # one round trip on loopback, plus a second
    assert received == 0


def test_a_receiver_that_is_down_is_retried_until_the_deadline_not_refused(pki):
    """Only a refusal is final: a receiver not yet listening is a timeout after retries (this
    deadline, 1.5 s, is shorter than the default ``unreachable_ms``, 3 s)."""
    import socket

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]

    async def scenario():
        started = time.monotonic()
        with pytest.raises(TransferError) as err:
            await send_one(f"127.0.0.1:{port}", tls_for(pki, "site-a", server_name="site-b"))
        return err.value, time.monotonic() - started

    error, elapsed = run(scenario())

    assert type(error) is TransferTimeout
    assert elapsed >= FAST_FAIL.timeout_ms / 1000 * 0.9


@pytest.mark.parametrize("receiver_state", ["nothing listens", "listens, never answers"])
def test_a_receiver_out_of_reach_fails_as_unreachable_within_its_bound(pki, receiver_state):
    """A cut path or a dead receiver is ``ReceiverUnreachable`` once Begin has failed for
    ``unreachable_ms`` -- long before the transfer's deadline -- naming the target and the
    bound; a receiver whose port accepts connections but never answers (a hung process, a
    black-holed path behind a proxy) is unreachable too, by Begin's RPC deadline."""
    import socket

    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    port = hold.getsockname()[1]
    if receiver_state == "nothing listens":
        hold.close()
    else:
        hold.listen(16)  # the kernel completes TCP handshakes; nothing reads or answers
    options = LinkOptions(timeout_ms=30000, rpc_timeout_ms=500, unreachable_ms=1500)

    async def scenario():
        started = time.monotonic()
        with pytest.raises(TransferError) as err:
            await send_one(
                f"127.0.0.1:{port}", tls_for(pki, "site-a", server_name="site-b"), options
            )
        return err.value, time.monotonic() - started

    try:
        error, elapsed = run(scenario())
    finally:
        hold.close()

    assert type(error) is ReceiverUnreachable, error
    assert f"receiver 127.0.0.1:{port} unreachable for 1500 ms" in str(error)
    assert 1.5 * 0.9 <= elapsed < 10  # the bound (plus one RPC), not the 30 s deadline


def test_server_certificate_is_reloaded_without_restart(pki, tmp_path):
    # The receiver's files start as site-b's; an operator re-issues them with a new name.
    for name in ("ca.pem", "site-b.pem", "site-b-key.pem"):
        shutil.copy(pki["ca"].ca_file.parent / name, tmp_path / name)
    server_tls = TLSConfig.from_dir(tmp_path, "site-b")
    renamed_client = tls_for(pki, "site-a", server_name="renamed-b")

    async def scenario():
        async with receiver(tls=server_tls) as (_server, target):
            with pytest.raises(TransferError):
                await send_one(target, renamed_client)
            create_node_cert(pki["ca"], tmp_path, "site-b", sans=["renamed-b"])
            return await send_one(target, renamed_client, LinkOptions(timeout_ms=5000))

    assert run(scenario()).bytes_raw == 900


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="ca_file"):
        TLSConfig(ca_file=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cert_file"):
        TLSConfig(ca_file=__file__)
    with pytest.raises(ValueError, match="allowed_peers"):
        TLSConfig(insecure=True, allowed_peers=["x"])


def transfer_through_a_flip(pki, data, options, offset, fresh_rate=False):
    """Send ``data`` as one layer over mTLS through a FaultProxy that flips the byte at stream
    ``offset`` of the first connection to reach it; (bytes flipped, summary, bytes received).
    ``fresh_rate``: forget the link rate measured for the proxy's address (``auto`` probes)."""
    from grpc_kv import link as link_module
    from grpc_kv.faultproxy import FaultProxy, Flip

    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(tls=server_tls) as (server, target):
            proxy = FaultProxy(upstream=target)
            via = f"127.0.0.1:{await proxy.start()}"
            if fresh_rate:
                link_module._MEASURED.pop(via, None)
            flip = proxy.add(Flip(direction="upstream", offsets=(offset,), limit=1))
            header = make_header({"kv": len(data)})
            consumer = asyncio.create_task(server.open(header.transfer_id, 20.0))
            client = tls_for(pki, "site-a", server_name="site-b")
            try:
                async with open_transfer(via, header, options, client) as tx:
                    await tx.send_layer("kv", data)
                    summary = await tx.finish()
                async with await consumer as reader:
                    received = b"".join([s.data async for s in reader])
            finally:
                await proxy.stop()
            return flip.flipped, summary, received

    return run(scenario())


def test_byte_flipped_on_an_mtls_link_during_the_auto_rate_measurement_is_a_connection_failure(
    pki,
):
    """A flipped byte breaks the TLS record MAC: the connection dies with INTERNAL in the
    middle of ``auto``'s link-rate probe. The transfer must go on (reconnect, resume) and
    deliver intact bytes, never leak a raw AioRpcError from ``send_layer``."""
    from tests.grpc_kv.kvtest import bf16_normal

    data = bf16_normal(2 << 20)
    options = LinkOptions(
        chunk_size_bytes=256 * 1024, compression="auto", connections=2, timeout_ms=20_000
    )
    # Past the TLS handshake and Begin, inside the first 1 MiB probe block.
    flipped, summary, received = transfer_through_a_flip(
        pki, data, options, 300_000, fresh_rate=True
    )

    assert flipped == 1
    assert received == data
    assert summary.bytes_raw == len(data)


def test_an_mtls_handshake_slower_than_a_second_still_connects(pki):
    """A connection's TLS handshake and HTTP/2 settings across a WAN take several round
    trips. gRPC gives a connection attempt ``grpc.min_reconnect_backoff_ms`` at least (its
    "min connect timeout"): at 100 ms every attempt through 400 ms each way was cut short
    ("Handshake read failed (Endpoint closing)", "timed out before receiving SETTINGS
    frame") and the transfer never connected -- what made a vLLM testbed's first transfers
    miss their deadline through two proxies on a loaded host."""
    from grpc_kv.faultproxy import FaultProxy, Latency

    options = LinkOptions(timeout_ms=30_000, unreachable_ms=20_000, connections=1)

    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(tls=server_tls) as (server, target):
            proxy = FaultProxy(upstream=target)
            port = await proxy.start()
            proxy.add(Latency(ms=400))
            header = make_header({"l0": 900})
            consumer = asyncio.create_task(server.open(header.transfer_id, 30.0))
            t0 = time.monotonic()
            try:
                async with open_transfer(
                    f"127.0.0.1:{port}", header, options,
                    tls_for(pki, "site-a", server_name="site-b"),
                ) as tx:  # fmt: skip
                    await tx.send_layer("l0", b"secret kv" * 100)
                    summary = await tx.finish()
                async with await consumer as reader:
                    got = b"".join([s.data async for s in reader])
            finally:
                await proxy.stop()
            return summary, got, time.monotonic() - t0

    summary, got, seconds = run(scenario())

    assert summary.bytes_raw == 900
    assert got == b"secret kv" * 100
    assert seconds < 25  # connected, not saved by the deadline


def test_chunks_on_an_mtls_connection_broken_mid_transfer_count_as_sent_again(pki):
    """A byte flipped inside a chunk breaks the TLS record and the connection with it; the
    chunks it carried go again after the resume, and ``retransmits`` / ``resent_bytes`` say
    so (what the vLLM corrupted-chunk test waits for on the connector's metrics)."""
    from tests.grpc_kv.kvtest import bf16_normal

    data = bf16_normal(2 << 20)
    options = LinkOptions(
        chunk_size_bytes=1 << 20, compression="none", connections=1, timeout_ms=20_000
    )
    # Past the handshake and Begin, inside the first chunk.
    flipped, summary, received = transfer_through_a_flip(pki, data, options, 100_000)

    assert flipped == 1
    assert received == data
    assert summary.resumes >= 1
    assert summary.retransmits >= 1
    assert summary.resent_bytes >= 1 << 20
