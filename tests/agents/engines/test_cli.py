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
