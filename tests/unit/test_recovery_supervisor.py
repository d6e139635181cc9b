"""The in-run recovery's skeleton (docs/design.md §5.12), one rule for every part: ``RecoverySupervisor`` over
parts that are test-only fakes of ``SupervisedPart`` (they isolate the supervisor from Ray and Gym; the real parts
run in tests/functional/test_gym_recovery.py, test_generation_recovery.py and test_recovery_supervision.py).

What is checked: a start that fails or runs past ``timeout_s`` counts as one more start and is tried again; the
bound gives a part up (``moved``, or ``given_up`` when nothing can take its work: the run stops); two parts
recover side by side; every recovery's row is written, also when the run ends while it waits for its first
re-dispatch; the per-step metrics carry upstream's names and reach the loggers under them."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.recovery.records import Loss, RecoveryRecord
from nemo_rl.algorithms.single_controller_utils.recovery.supervisor import RecoveryFailed, RecoverySupervisor
from nemo_rl.utils.loggers.names import step_metrics


class Rows:
    """Test-only stand-in for ``RunRecords``: keeps the rows written."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def recovery(self, row: dict) -> None:
        self.rows.append(row)


class FakePart:
    """Test-only ``SupervisedPart``: loses itself when ``lose()`` is called; each start takes ``start_s`` (or
    fails while ``failing_starts`` > 0); ``settle`` waits for ``redispatched`` (never set: the run's end)."""

    kind = "gym_replica"

    def __init__(self, name: str, *, start_s: float = 0.0, failing_starts: int = 0, movable: bool = True):
        self.name, self.label = name, f"Gym {name}"
        self.start_s, self.failing_starts, self.movable = start_s, failing_starts, movable
        self.losses: asyncio.Queue[Loss] = asyncio.Queue()
        self.started: list[tuple[float, float]] = []  # (began, ended) per successful start
        self.redispatched = asyncio.Event()
        self.resumed = asyncio.Event()

    def lose(self, cause: str = "died (exit -9, SIGKILL)") -> None:
        self.losses.put_nowait(Loss(self.name, "workplace_assistant", cause, "watch"))

    async def watch(self) -> Loss:
        return await self.losses.get()

    async def replace(self, loss: Loss, deadline: float) -> str:
        began = time.monotonic()
        await asyncio.sleep(self.start_s)
        if self.failing_starts:
            self.failing_starts -= 1
            raise RuntimeError("a server died while starting")
        self.started.append((began, time.monotonic()))
        return "restarted"

    async def give_up(self, loss: Loss, why: str, record: RecoveryRecord) -> None:
        if not self.movable:
            raise RecoveryFailed(f"{self.name} is given up: {why}; the run stops")

    async def resume(self, loss: Loss, record: RecoveryRecord) -> None:
        record.continued_turn = ["r1"]
        self.resumed.set()

    async def settle(self, loss: Loss, record: RecoveryRecord) -> None:
        await self.redispatched.wait()
        record.seconds_to_redispatch = round(time.monotonic() - loss.noticed, 3)

    def line(self, record: RecoveryRecord) -> str:
        return f"recovered {self.name}: {record.action}"

    def gauges(self) -> dict[str, float]:
        return {}


def settings(**kw) -> InRunRecoveryConfig:
    return InRunRecoveryConfig(**{"max_recoveries": 3, "window_s": 600.0, "timeout_s": 5.0, **kw})


async def test_two_parts_recover_side_by_side_and_each_row_waits_for_its_redispatch():
    a, b = FakePart("r0", start_s=0.3), FakePart("r1", start_s=0.3)
    rows = Rows()
    sup = RecoverySupervisor(settings(), rows, [a, b])
    run = asyncio.create_task(sup.run())
    a.lose()
    b.lose()
    await asyncio.wait_for(asyncio.gather(a.resumed.wait(), b.resumed.wait()), 5)
    (a0, a1), (b0, b1) = a.started[0], b.started[0]
    assert b0 < a1 and a0 < b1  # the starts overlapped: neither waited for the other
    assert rows.rows == []  # each row waits for its first re-dispatch
    a.redispatched.set()
    b.redispatched.set()
    await asyncio.sleep(0.05)
    assert sorted(r["instance"] for r in rows.rows) == ["r0", "r1"]
    assert all(r["action"] == "restarted" and r["seconds_to_redispatch"] is not None for r in rows.rows)
    metrics = sup.step_metrics()
    assert metrics["supervisor/restarts_started"] == metrics["supervisor/restarts_succeeded"] == 2.0
    assert metrics["supervisor/rollouts_continued"] == 2.0 and metrics["supervisor/restarts_in_flight"] == 0.0
    assert metrics["supervisor/recoveries/gym_replica/restarted"] == 2.0
    assert "supervisor/rollouts_continued" not in sup.step_metrics()  # per step: taken once
    logged = step_metrics({"step": 1, **metrics})  # what every logger gets: upstream's names, not train/...
    assert logged["supervisor/restarts_started"] == 2.0 and not any(k.startswith("train/supervisor") for k in logged)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_a_start_past_its_deadline_is_tried_again_then_the_part_is_given_up():
    part = FakePart("r1", start_s=1.0, movable=True)
    rows = Rows()
    sup = RecoverySupervisor(settings(timeout_s=0.2, max_recoveries=2), rows, [part])
    run = asyncio.create_task(sup.run())
    part.lose()
    await asyncio.wait_for(part.resumed.wait(), 5)
    part.redispatched.set()
    await asyncio.sleep(0.05)
    [row] = rows.rows
    assert row["action"] == "moved" and "max_recoveries=2" in row["given_up"], row
    assert len(row["failed_starts"]) == 2 and "did not finish within 0.2 s" in row["failed_starts"][0], row
    assert sup.step_metrics()["supervisor/start_attempts/gym_replica"] == 2.0
    await asyncio.wait_for(run, 5)  # the part was given up: nothing left to supervise, the loop ends


async def test_a_part_given_up_with_nowhere_to_go_stops_the_run_and_its_row_is_written():
    part = FakePart("r0", failing_starts=5, movable=False)
    rows = Rows()
    sup = RecoverySupervisor(settings(max_recoveries=2), rows, [part])
    part.lose()
    with pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(sup.run(), 5)
    assert isinstance(raised.value.exceptions[0], RecoveryFailed)
    [row] = rows.rows
    assert row["action"] == "given_up" and len(row["failed_starts"]) == 2, row
    assert sup.step_metrics()["supervisor/restarts_failed"] == 1.0


async def test_the_row_is_written_when_the_run_ends_while_it_waits_for_its_first_redispatch():
    part = FakePart("r1")
    rows = Rows()
    sup = RecoverySupervisor(settings(), rows, [part])
    run = asyncio.create_task(sup.run())
    part.lose()
    await asyncio.wait_for(part.resumed.wait(), 5)
    await asyncio.sleep(0.05)
    assert rows.rows == []  # waiting for the first re-dispatch
    run.cancel()  # the run ends
    with pytest.raises(asyncio.CancelledError):
        await run
    [row] = rows.rows
    assert row["instance"] == "r1" and row["seconds_to_redispatch"] is None and row["continued_turn"] == ["r1"]
