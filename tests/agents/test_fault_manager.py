"""FaultManager in-process: journal before apply, retry of a failed restore, restore of a
previous agent's journal. The injector here is a recording test injector (the real ones
need a network namespace or children and are tested end to end elsewhere)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from agents import faults
from agents.config import FaultsConfig
from agents.faults import Fault, FaultContext, FaultError, FaultInjector
from agents.faults.manager import FaultManager, Journal
from tests.support import deadline_in


class Recording(FaultInjector):
    """Records calls; fails ``apply`` or the first ``restore`` when told to."""

    calls: ClassVar[list[tuple[str, float, bool]]] = []
    fail_apply: ClassVar[bool] = False
    restore_failures: ClassVar[int] = 0
    journal: ClassVar[Path | None] = None

    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        fault.mechanism = "recording"

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        assert self.journal is not None
        journalled = [f["id"] for f in json.loads(self.journal.read_text())["faults"]]
        self.calls.append(("apply", time.monotonic(), fault.id in journalled))
        if self.fail_apply:
            raise FaultError("mechanism", "refused", "INTERNAL")

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        self.calls.append(("restore", time.monotonic(), True))
        if Recording.restore_failures > 0:
            Recording.restore_failures -= 1
            raise FaultError("mechanism", "not yet", "INTERNAL")


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[FaultManager]:
    faults.INJECTORS["recording"] = "tests.agents.test_fault_manager:Recording"
    Recording.calls = []
    Recording.fail_apply = False
    Recording.restore_failures = 0
    Recording.journal = tmp_path / "faults.json"
    yield FaultManager(Journal(tmp_path / "faults.json"), FaultContext(FaultsConfig(), {}), 60)
    del faults.INJECTORS["recording"]


def test_journal_is_written_before_apply_and_a_failed_apply_is_undone(
    manager: FaultManager,
) -> None:
    async def scenario() -> None:
        await manager.start()
        Recording.fail_apply = True
        with pytest.raises(FaultError):
            await manager.inject("recording", "x", 5, {})
        await manager.close()

    asyncio.run(scenario())
    assert [(name, journalled) for name, _, journalled in Recording.calls] == [
        ("apply", True),
        ("restore", True),
    ]
    assert manager.active == {}
    assert manager.journal.load() == []


def test_failed_restore_is_retried_not_spun(manager: FaultManager) -> None:
    async def scenario() -> None:
        await manager.start()
        Recording.restore_failures = 1
        await manager.inject("recording", "x", 0.2, {})
        deadline = deadline_in(5)
        while manager.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await manager.close()

    asyncio.run(scenario())
    restores = [t for name, t, _ in Recording.calls if name == "restore"]
    assert len(restores) == 2
    assert restores[1] - restores[0] >= 0.9
    assert manager.active == {}


def test_start_restores_what_a_previous_agent_journalled(
    manager: FaultManager, tmp_path: Path
) -> None:
    leftover = Fault(
        "old1", "recording", "x", {}, "2026-01-01T00:00:00Z", "2099-01-01T00:00:00Z", 4.1e9
    )
    manager.journal.save([leftover])

    async def scenario() -> int:
        restored = await manager.start()
        await manager.close()
        return restored

    assert asyncio.run(scenario()) == 1
    assert [name for name, _, _ in Recording.calls] == ["restore"]
    assert json.loads((tmp_path / "faults.json").read_text()) == {"faults": []}


def test_clear_whose_restore_fails_says_so_and_keeps_the_fault(manager: FaultManager) -> None:
    async def scenario() -> tuple[FaultError, list[str]]:
        await manager.start()
        fault = await manager.inject("recording", "x", 30, {})
        Recording.restore_failures = 1
        with pytest.raises(FaultError) as err:
            await manager.clear(fault.id)
        still = list(manager.active)
        await manager.clear(fault.id)  # the next try succeeds
        await manager.close()
        return err.value, still

    error, still = asyncio.run(scenario())
    assert error.code == "UNAVAILABLE"
    assert str(error).startswith(f"id: restore failed for {still[0]} (mechanism: not yet)")
    assert len(still) == 1
    assert manager.active == {}


@pytest.mark.parametrize(
    "text", ["{not json", '{"faults": [{"id": "x", "shape": "of another version"}]}', "[1, 2]"]
)
def test_unreadable_journal_is_moved_aside_not_fatal(
    manager: FaultManager, tmp_path: Path, text: str
) -> None:
    (tmp_path / "faults.json").write_text(text)

    async def scenario() -> int:
        restored = await manager.start()
        await manager.close()
        return restored

    assert asyncio.run(scenario()) == 0
    assert (tmp_path / "faults.json.unreadable").read_text() == text  # kept for an operator
    assert not (tmp_path / "faults.json").exists()
