"""``pdbridge engine serve`` flags that build the grpc_kv link options of an engine's sends."""

import pytest

from agents.engines.cli import _serve_parser, link_options
from grpc_kv.api import Checksum, Codec

BASE = ["--model", "gemma3", "--kv-insecure"]


def options(*flags):
    return link_options(_serve_parser().parse_args([*BASE, *flags]))


def test_defaults_checksum_every_chunk_with_xxh3():
    opts = options()

    assert opts.checksum is Checksum.XXH3
    assert opts.compression is Codec.AUTO


def test_no_verify_kv_digests_turns_the_link_checksums_off_too():
    """A deployment's checksum=false arrives as --no-verify-kv-digests (orchestrator.agentops):
    then nothing on the path verifies the KV bytes, the link included."""
    opts = options("--no-verify-kv-digests", "--kv-compression", "none")

    assert opts.checksum is Checksum.NONE
    assert opts.compression is Codec.NONE


@pytest.mark.parametrize("kind", ["xxh3", "crc32c", "none"])
def test_kv_checksum_is_passed_through(kind):
    assert options("--kv-checksum", kind).checksum is Checksum(kind)


def test_kv_checksum_contradicting_no_verify_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--kv-checksum: crc32c contradicts"):
        options("--no-verify-kv-digests", "--kv-checksum", "crc32c")


def test_unknown_kv_checksum_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        _serve_parser().parse_args([*BASE, "--kv-checksum", "md5"])

    assert exc.value.code == 2


def test_the_deployments_deadline_retries_and_chunk_size_become_the_sends_options():
    """What ``orchestrator.agentops`` passes from ``kv_transfer`` (timeout_ms, retry,
    chunk_size_mb) is what the engine's link uses; grpc_kv's defaults only when absent."""
    opts = options("--kv-timeout-ms", "15000", "--kv-retry", "0", "--kv-chunk-size-mb", "0.5")
    defaults = options()

    assert (opts.timeout_ms, opts.retry, opts.chunk_size_bytes) == (15000, 0, 512 * 1024)
    assert (defaults.timeout_ms, defaults.retry, defaults.chunk_size_bytes) == (4000, 3, 4 << 20)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--kv-timeout-ms", "0"), ("--kv-retry", "-1"), ("--kv-chunk-size-mb", "0")],
)
def test_an_out_of_range_link_setting_is_refused_naming_the_option(flag, value):
    with pytest.raises(ValueError, match=f"^{flag}: must be"):
        options(flag, value)
