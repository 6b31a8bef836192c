"""The loopback benchmark's reference methods (bench/kv_baselines.py): plain TCP and checked TCP;
and its receiver whose consumer keeps what the link delivers.

Their figures are what the KV link's goodput is judged against, so they must move every
byte they claim to and, for checked TCP, verify it: a reference that skipped its checksum
would make the link look slower than it is. A "kept" transfer must really reach a consumer.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import struct
import subprocess
import sys

import pytest
import xxhash

import bench.kv
from bench.kv import loopback_options, measured_send, start_receiver, summary, verdicts
from bench.kv_baselines import CHECKED_PREFIX, SINK, tcp_baseline
from bench.kv_peers import MIB, bench_child


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("connections", [1, 3])
def test_a_baseline_moves_the_bytes_and_reports_both_sides_cpu(
    checked: bool, connections: int
) -> None:
    data = os.urandom(8 * MIB)
    rate, cpu = tcp_baseline(24 * MIB, connections, data, checked=checked)
    assert rate > 0
    assert cpu["sender"] > 0
    assert cpu["receiver"] > 0


def test_the_checked_sink_verifies_every_slice_and_says_which_failed() -> None:
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK, "1", "checked"], stdout=subprocess.PIPE, text=True
    )
    assert sink.stdout is not None
    try:
        port = int(sink.stdout.readline())
        good = os.urandom(300_001)  # odd length: the sink reads exactly what the prefix says
        bad = bytearray(good)
        bad[12_345] ^= 0x01
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for block in (good, bytes(bad), good):
                sock.sendall(CHECKED_PREFIX.pack(len(block), xxhash.xxh3_64_intdigest(good)))
                sock.sendall(block)
            answers = b""
            while len(answers) < 24:
                chunk = sock.recv(24 - len(answers))
                assert chunk, "the sink closed before acknowledging every slice"
                answers += chunk
        assert [v for (v,) in struct.iter_unpack("<q", answers)] == [0, -1, 2]
        assert float(sink.stdout.readline()) >= 0  # its CPU seconds, once the sender is gone
    finally:
        sink.kill()
        sink.wait(timeout=10)


def test_a_kept_transfer_is_read_to_its_last_byte_by_the_receivers_consumer(monkeypatch) -> None:
    monkeypatch.setattr(bench.kv, "RUNNER", asyncio.Runner())  # the bench's own closes once
    receiver, target = start_receiver(consumer=True)
    try:
        with bench.kv.RUNNER:
            rate, cpu = measured_send(
                target,
                [receiver.pid],
                32 * MIB,
                loopback_options(2),
                "bulk",
                os.urandom(2 * MIB),
                kept=receiver,
            )  # raises unless the consumer answers with this transfer and all 32 MiB
        assert rate > 0
        assert cpu["receiver"] > 0
    finally:
        assert receiver.stdin is not None
        receiver.stdin.close()
        assert receiver.wait(timeout=20) == 0


def test_a_consumer_that_cannot_read_answers_with_its_error_instead_of_leaving_the_bench_hanging(
    tmp_path,
) -> None:
    engine = bench_child("consumer", str(tmp_path / "no-sidecar.sock"))
    assert engine.stdin is not None
    assert engine.stdout is not None
    try:
        engine.stdin.write("t-nobody\n")
        engine.stdin.flush()
        ready, _, _ = select.select([engine.stdout], [], [], 30)
        assert ready, "no answer within 30 s"
        answer = json.loads(engine.stdout.readline())
    finally:
        engine.kill()
        engine.wait(timeout=10)

    assert answer["transfer_id"] == "t-nobody"
    assert answer["error"].startswith("TransferFailed: ")
    assert "bytes" not in answer


def test_the_summary_names_each_ratio_and_every_missed_target() -> None:
    row = {
        "best_data_path": "bulk",
        "best_ratio": 0.7,
        "ratio": 0.3,
        "kv_bulk_mb_s": 2800.0,
        "kv_mb_s": 1200.0,
        "tcp_mb_s": 4000.0,
        "median_ratio_bulk": 0.75,
        "median_ratio": 0.3,
        "checked_ratio_to_tcp": 0.72,
        "ratio_bulk_to_checked": 0.97,
        "kept_ratio_to_discard": 0.95,
        "local_ratio_to_kept": 0.5,
    }
    results = {
        "shaped_200mbit": {"none": {"ratio_to_shaped_rate": 0.95}},
        "loopback_unshaped": {"4_connections": row},
    }
    results["verdicts"] = verdicts(results)
    lines = summary(results)
    assert "shaped 200 Mbit/s, none: 0.950 x the shaped rate" in lines
    assert any(
        line.startswith("loopback, 4 connection(s): link (bulk path) 0.700 x plain TCP (2800 vs")
        and "checked TCP 0.720 x plain TCP; bulk path 0.970 x checked TCP; kept by a consumer"
        " 0.950 x discarded"
        in line
        for line in lines
    )
    assert "goodput_200mbit_none >= 0.93: ok" in lines
    assert "loopback_4_connections >= 0.8 x tcp: MISSED" in lines
