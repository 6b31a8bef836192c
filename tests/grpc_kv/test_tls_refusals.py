"""A refused peer is named: the refusal (and so the receiver's ``peer_rejected`` log line)
carries the certificate's subject and every name it has, on the gRPC and the bulk path."""

import logging
import ssl

import grpc
import pytest

from grpc_kv.api import LinkOptions, PeerRejected, TLSConfig, TransferRefused, open_transfer
from grpc_kv.tls import peercert_subject
from tests.grpc_kv.kvtest import make_header, receiver, run

FAST_FAIL = LinkOptions(timeout_ms=1500, rpc_timeout_ms=500)


def tls_for(pki, name, **kw):
    files = pki[name]
    return TLSConfig(
        ca_file=files.ca_file, cert_file=files.cert_file, key_file=files.key_file, **kw
    )


def decoded(pki, name):
    """The peer certificate as ``SSLObject.getpeercert()`` returns it (the same decoder)."""
    return ssl._ssl._test_decode_cert(str(pki[name].cert_file))  # type: ignore[attr-defined]


def test_a_peer_refused_on_the_grpc_path_is_logged_with_its_subject_and_names(pki, caplog):
    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(tls=server_tls) as (server, target):
            header = make_header({"l0": 0})
            client = tls_for(pki, "intruder", server_name="site-b")
            with pytest.raises(TransferRefused) as err:
                async with open_transfer(target, header, FAST_FAIL, client) as tx:
                    await tx.send_layer("l0", b"kv" * 100)
            rejected = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
            )
            return err.value.code, rejected

    with caplog.at_level(logging.WARNING, logger="grpc_kv.receiver"):
        code, rejected = run(scenario())

    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert rejected == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("peer_rejected")]
    assert lines
    assert (
        "reason=peer 'intruder' is not on the allowlist (certificate CN=intruder; "
        "names intruder; only the common name is matched)"
    ) in lines[0]


def test_the_bulk_path_names_the_subject_of_the_certificate_it_refuses(pki):
    tls = tls_for(pki, "site-b", allowed_peers=["site-a"])

    with pytest.raises(PeerRejected) as err:
        tls.check_peercert(decoded(pki, "intruder"))

    assert str(err.value) == (
        "peer 'intruder' is not on the allowlist (certificate CN=intruder; "
        "names intruder; only the common name is matched)"
    )
    assert tls.check_peercert(decoded(pki, "site-a")) == "site-a"


def test_a_subject_is_written_as_grpc_writes_it():
    cert = {
        "subject": (
            (("countryName", "NL"),),
            (("organizationName", "site b"),),
            (("commonName", "node-1"),),
        )
    }

    assert peercert_subject(cert) == "CN=node-1,O=site b,C=NL"
    assert peercert_subject({}) is None
    assert peercert_subject(None) is None
