"""The agent's TLS report from real certificate files: fields, rotation picked up without a
restart, insecure agents, and unreadable files reported rather than raised."""

from __future__ import annotations

import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from agents.config import AgentConfig, TLSConfig
from agents.tlsreport import TlsReporter
from grpc_kv.certs import create_ca, create_node_cert


def _not_after(report: dict[str, object]) -> datetime:
    return datetime.fromisoformat(str(report["not_after"]).replace("Z", "+00:00"))


def test_report_reads_the_certificate_and_follows_a_rotation(tmp_path: Path) -> None:
    ca = create_ca(tmp_path / "ca")
    short = create_node_cert(ca, tmp_path / "short", "dec-1", sans=["dec-1.example"], days=3)
    long = create_node_cert(ca, tmp_path / "long", "dec-1", days=300)
    live = tmp_path / "live.pem"
    shutil.copy(short.cert_file, live)
    config = AgentConfig(
        tls=TLSConfig(
            ca=str(ca.ca_file),
            cert=str(live),
            key=str(short.key_file),
            allowed_identities=["a", "b"],
        )
    )
    reporter = TlsReporter(config)

    first = reporter.report()
    shutil.copy(long.cert_file, live)
    os.utime(live, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    second = reporter.report()

    assert first["mtls"] is True
    assert first["subject"] == "dec-1"
    assert first["sans"] == ["dec-1", "dec-1.example"]  # the node's own names, no loopback
    assert first["allowlist_size"] == 2
    assert len(str(first["ca_fingerprint"])) == 64
    assert 2.9 < (_not_after(first) - datetime.now(UTC)).total_seconds() / 86400 <= 3
    assert 299 < (_not_after(second) - datetime.now(UTC)).total_seconds() / 86400 <= 300
    assert second["ca_fingerprint"] == first["ca_fingerprint"]


def test_insecure_agent_reports_mtls_off() -> None:
    report = TlsReporter(AgentConfig(insecure=True)).report()

    assert report["mtls"] is False
    assert report["not_after"] is None


def test_an_unreadable_certificate_is_reported_as_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "cert.pem"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    config = AgentConfig(tls=TLSConfig(ca=str(bad), cert=str(bad), key=str(bad)))

    report = TlsReporter(config).report()

    assert report["mtls"] is True
    assert str(report["error"]).startswith("tls: cannot read the certificate or CA: ")
    assert report["not_after"] is None
