"""mTLS on the KV link: who gets in, who is refused, and certificate reload."""

import shutil

import grpc
import pytest

from grpc_kv.api import (
    LinkOptions,
    TLSConfig,
    TransferError,
    TransferRefused,
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


@pytest.mark.parametrize("client", ["foreign-ca", "plaintext"])
def test_client_from_another_ca_or_in_plaintext_cannot_transfer(pki, client):
    async def scenario():
        async with receiver(tls=tls_for(pki, "site-b")) as (server, target):
            tls = (
                tls_for(pki, "foreign", server_name="site-b")
                if client == "foreign-ca"
                else TLSConfig(insecure=True)
            )
            with pytest.raises(TransferError):
                await send_one(target, tls)
            return server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")

    assert run(scenario()) == 0


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
