"""The prepare round's per-replica state machine (``prepare_rounds.py``) and the owner of the
background reopenings (``reopenings.py``), with real asyncio futures as the replicas' calls.

Time is passed in (``now``), so each transition is checked at a chosen instant, not by sleeping.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from gym_patches.checkpoint.coordination import CoordinationError, PrepareResult
from nemo_rl.algorithms.single_controller_utils.prepare_rounds import (
    MAX_BUSY_PROBES,
    PrepareRound,
    ReplicaState,
    RoundClock,
)
from nemo_rl.algorithms.single_controller_utils.reopenings import Reopenings
from nemo_rl.environments.gym_checkpoint_adapter import GymServerProbe

GRACE = 1.5
CLOCK = RoundClock(started=100.0, hard_stop=200.0, park_grace_s=GRACE, probe_after_s=0.5, probe_every_s=1.0)
ANSWERS = {"agent": GymServerProbe(True, "phase preparing, 2 blocking", 2, ["r1", "r2"]),
           "tools": GymServerProbe(True, "phase prepared, 0 blocking")}
SILENT = {"agent": GymServerProbe(True, "phase preparing"),
          "tools": GymServerProbe(False, "no reply within 1.5s")}


class RayTaskError(Exception):
    """Shaped like Ray's task-error wrapper: the replica's own error is its ``cause``."""

    def __init__(self, cause: BaseException):
        super().__init__(f"task failed: {cause}")
        self.cause = cause


def new_round(*iids: str) -> tuple[PrepareRound, dict[str, asyncio.Future]]:
    loop = asyncio.get_running_loop()
    calls = {iid: loop.create_future() for iid in iids}
    return PrepareRound.start("c1", dict(calls), CLOCK), calls


def answered_probe(answer) -> asyncio.Future:
    probe = asyncio.get_running_loop().create_future()
    if isinstance(answer, BaseException):
        probe.set_exception(answer)
    else:
        probe.set_result(answer)
    return probe


async def test_a_prepare_that_answers_parks_or_is_not_ready():
    rnd, calls = new_round("r0", "r1")
    calls["r0"].set_result(PrepareResult(prepared=True))
    calls["r1"].set_result(PrepareResult(prepared=False, blockers={"agent": ["k1"]}))
    assert rnd.read_answers() == []
    assert rnd.replicas["r0"].state is ReplicaState.PARKED
    assert rnd.replicas["r1"].state is ReplicaState.NOT_READY
    assert rnd.waiting() == [] and set(rnd.results()) == {"r0", "r1"} and rnd.failures() == {}
    assert not rnd.others_prepared()  # one that is not ready holds the grace: the attempt fails as not ready
    await rnd.close()


async def test_a_prepare_a_server_did_not_answer_leaves_and_any_other_error_fails():
    rnd, calls = new_round("r0", "r1")
    silent = CoordinationError("tools", None, "timeout", "no reply within 5s")
    calls["r0"].set_exception(RayTaskError(silent))  # unwrapped: the replica's own error decides
    calls["r1"].set_exception(CoordinationError("agent", 409, "checkpoint_conflict", "c0 is active"))
    left = rnd.read_answers()
    assert [r.iid for r in left] == ["r0"]
    assert rnd.replicas["r0"].state is ReplicaState.LEFT_OUT
    assert rnd.replicas["r0"].why_left == f"r0: {silent}"
    assert rnd.replicas["r1"].state is ReplicaState.FAILED
    assert list(rnd.failures()) == ["r1"] and "checkpoint_conflict" in str(rnd.failures()["r1"])
    await rnd.close()


async def test_a_slow_replica_is_probed_after_the_probe_delay_and_then_every_period():
    rnd, _ = new_round("r0")
    assert rnd.due_for_probe(100.4) == []  # not slow yet
    [slow] = rnd.due_for_probe(100.5)
    slow.probe_sent(answered_probe(ANSWERS), 100.5)
    assert slow.state is ReplicaState.PROBING and rnd.due_for_probe(101.0) == []  # one probe at a time
    assert rnd.read_answers() == []
    assert slow.state is ReplicaState.ASKED and slow.last_probe == ANSWERS
    assert rnd.due_for_probe(101.4) == []  # probed 0.9 s ago
    assert rnd.due_for_probe(101.5) == [slow]
    await rnd.close()


async def test_a_server_silent_to_a_probe_takes_its_replica_out_at_once():
    rnd, _ = new_round("r0")
    replica = rnd.replicas["r0"]
    replica.probe_sent(answered_probe(SILENT), 100.5)
    assert rnd.read_answers() == [replica]
    assert replica.state is ReplicaState.LEFT_OUT and replica.prepare.cancelled()
    assert replica.why_left == "Gym server 'tools' on r0 did not answer (no reply within 1.5s)"
    await rnd.close()


BUSY = {"agent": GymServerProbe(False, "no reply within 1.5s (busy: its process ran 80% of a core meanwhile)",
                                busy=True),
        "tools": GymServerProbe(True, "phase preparing")}


async def test_a_busy_silent_server_is_waited_on_for_a_few_probes_then_its_replica_leaves():
    rnd, calls = new_round("r0")
    replica = rnd.replicas["r0"]
    for i in range(MAX_BUSY_PROBES):  # silent but computing: thousands of rollouts, not a hang
        replica.probe_sent(answered_probe(BUSY), 100.5 + i)
        assert rnd.read_answers() == [], i
        assert replica.state is ReplicaState.ASKED and replica.busy_probes == i + 1
    replica.probe_sent(answered_probe(BUSY), 110.0)
    assert rnd.read_answers() == [replica] and replica.state is ReplicaState.LEFT_OUT
    assert "busy: its process ran 80% of a core" in replica.why_left
    await rnd.close()


async def test_a_busy_server_that_prepares_parks_and_a_busy_one_beside_a_hung_one_leaves():
    rnd, calls = new_round("r0", "r1")
    busy = rnd.replicas["r0"]
    busy.probe_sent(answered_probe(BUSY), 100.5)
    assert rnd.read_answers() == []
    calls["r0"].set_result(PrepareResult(prepared=True))
    assert rnd.read_answers() == [] and busy.state is ReplicaState.PARKED
    mixed = rnd.replicas["r1"]  # one busy server and one silent without computing: the hung one decides
    mixed.probe_sent(answered_probe({**BUSY, "tools": GymServerProbe(False, "no reply within 1.5s")}), 100.5)
    assert rnd.read_answers() == [mixed] and mixed.state is ReplicaState.LEFT_OUT
    await rnd.close()


async def test_a_probe_that_fails_is_logged_and_the_replica_is_probed_again(caplog):
    rnd, _ = new_round("r0")
    replica = rnd.replicas["r0"]
    replica.probe_sent(answered_probe(RuntimeError("actor is restarting")), 100.5)
    with caplog.at_level(logging.INFO):
        assert rnd.read_answers() == []
    assert replica.state is ReplicaState.ASKED and replica.last_probe is None
    assert "status probe of r0 failed" in caplog.text and "actor is restarting" in caplog.text
    assert rnd.due_for_probe(101.5) == [replica]
    await rnd.close()


async def test_a_probe_that_answers_after_the_prepare_only_updates_what_was_seen():
    rnd, calls = new_round("r0")
    replica = rnd.replicas["r0"]
    probe = asyncio.get_running_loop().create_future()
    replica.probe_sent(probe, 100.5)
    calls["r0"].set_result(PrepareResult(prepared=True))
    rnd.read_answers()
    assert replica.state is ReplicaState.PARKED
    probe.set_result(SILENT)  # too late to matter: the replica is prepared
    assert rnd.read_answers() == []
    assert replica.state is ReplicaState.PARKED and replica.last_probe == SILENT
    await rnd.close()


async def test_a_straggler_leaves_a_grace_after_the_others_parked_naming_what_blocks_it():
    rnd, calls = new_round("r0", "r1")
    calls["r0"].set_result(PrepareResult(prepared=True))
    rnd.read_answers()
    rnd.start_grace(100.0)
    assert rnd.others_prepared_at == 100.0
    [straggler] = rnd.due_for_probe(100.0)  # probed at once, before the probe delay: the reason names a server
    assert straggler.iid == "r1"
    straggler.probe_sent(answered_probe(ANSWERS), 100.0)
    rnd.read_answers()
    rnd.start_grace(100.5)
    assert rnd.others_prepared_at == 100.0  # the grace starts once
    assert rnd.stragglers(100.0 + GRACE - 0.01) == []
    assert rnd.stragglers(100.0 + GRACE) == [straggler]
    assert straggler.state is ReplicaState.LEFT_OUT and straggler.prepare.cancelled()
    assert straggler.why_left == ("r1 was not prepared within 1.5s after the other replicas; blocking: "
                                  "Gym server 'agent' (2 rollouts: r1, r2)")
    assert set(rnd.results()) == {"r0"}
    await rnd.close()


async def test_a_straggler_with_a_probe_under_way_waits_for_it_unless_it_is_late_itself():
    rnd, calls = new_round("r0", "r1")
    calls["r0"].set_result(PrepareResult(prepared=True))
    rnd.read_answers()
    rnd.start_grace(100.0)
    straggler = rnd.replicas["r1"]
    straggler.probe_sent(asyncio.get_running_loop().create_future(), 100.0)  # never answers
    assert rnd.stragglers(100.0 + GRACE) == []  # its answer would name the server: wait for it
    assert rnd.stragglers(100.0 + 2 * GRACE + 0.99) == []
    assert rnd.stragglers(100.0 + 2 * GRACE + 1.0) == [straggler]
    assert straggler.why_left == "r1 was not prepared within 1.5s after the other replicas"
    await rnd.close()
    assert straggler.probe is None  # cancelled and awaited by the round


@pytest.mark.parametrize("other", ["not_ready", "failed", "none"])
async def test_no_grace_starts_unless_every_other_replica_parked(other):
    rnd, calls = new_round("r0", "r1", "r2")
    calls["r0"].set_result(PrepareResult(prepared=True))
    if other == "not_ready":
        calls["r1"].set_result(PrepareResult(prepared=False, blockers={"agent": ["k"]}))
    elif other == "failed":
        calls["r1"].set_exception(ValueError("bad reply"))
    rnd.read_answers()
    rnd.start_grace(100.0)
    if other == "none":  # r1 and r2 both wait: the others (r0) parked, so both are stragglers
        assert rnd.others_prepared_at == 100.0
        assert {r.iid for r in rnd.stragglers(100.0 + GRACE)} == {"r1", "r2"}
    else:
        assert rnd.others_prepared_at is None and rnd.stragglers(150.0) == []
    await rnd.close()


async def test_a_lone_replica_never_straggles():
    rnd, _ = new_round("r0")
    rnd.start_grace(100.0)
    assert rnd.others_prepared_at is None and rnd.stragglers(199.0) == []
    await rnd.close()


async def test_past_the_hard_stop_every_waiting_replica_fails_with_a_timeout():
    rnd, calls = new_round("r0", "r1")
    calls["r0"].set_result(PrepareResult(prepared=False))
    rnd.read_answers()
    rnd.stop_the_late(199.9)
    assert rnd.replicas["r1"].waiting
    rnd.stop_the_late(200.0)
    r1 = rnd.replicas["r1"]
    assert r1.state is ReplicaState.FAILED and r1.prepare.cancelled()
    assert str(rnd.failures()["r1"]) == "prepare on r1 did not answer within 100.0s"
    assert rnd.waiting() == []
    await rnd.close()


async def test_close_cancels_awaits_and_reads_every_call_nobody_read(caplog):
    rnd, calls = new_round("r0", "r1", "r2")
    r0, r1, r2 = (rnd.replicas[i] for i in ("r0", "r1", "r2"))
    r0.probe_sent(asyncio.get_running_loop().create_future(), 100.5)  # still under way
    r1.leave("r1: it left")
    calls["r2"].set_exception(RuntimeError("prepare broke after its replica was given up"))
    r2.time_out(100.0)  # nothing read r2's prepare before the hard stop
    with caplog.at_level(logging.INFO):
        await rnd.close()
    assert all(r.prepare.done() for r in (r0, r1, r2)) and r0.probe is None
    assert r0.waiting and not r0.why_left  # a round closed early decides nothing more
    assert "the prepare of r2 (failed) ended with: prepare broke after its replica was given up" in caplog.text
    assert "r0" not in caplog.text and "r1" not in caplog.text  # cancelled by their owner: nothing to report


async def test_a_cancelled_prepare_stops_the_whole_round_through_close():
    """The coordinator's ``try/finally``: cancelling the awaiting task leaves no call running."""
    rnd, _ = new_round("r0", "r1")

    async def drive():
        try:
            while rnd.waiting():
                await rnd.next_event(0.01)
        finally:
            await rnd.close()

    driver = asyncio.create_task(drive())
    await asyncio.sleep(0.05)
    driver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await driver
    assert all(r.prepare.cancelled() for r in rnd.replicas.values())


# ----------------------------------------------------------------------------- reopenings
async def test_a_finished_reopening_is_reaped_and_its_error_logged_naming_the_replica(caplog):
    reopenings = Reopenings()
    gate = asyncio.Event()

    async def reopen_fails():
        raise RuntimeError("the actor of r0 died")

    async def reopen_waits():
        await gate.wait()

    reopenings.adopt("r0", asyncio.create_task(reopen_fails()), "Gym server 'tools' on r0 did not answer")
    waiter = asyncio.create_task(reopen_waits())
    reopenings.adopt("r1", waiter, "r1 was not prepared within 1.5s")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR):
        assert reopenings.running() == {"r1": "r1 was not prepared within 1.5s"}
    assert "reopening r0 after it left a snapshot failed" in caplog.text
    assert "RuntimeError: the actor of r0 died" in caplog.text
    gate.set()
    await waiter
    assert reopenings.running() == {}
    assert len(caplog.records) == 1  # each end is read once


async def test_aclose_cancels_and_awaits_every_reopening_and_reads_those_that_failed(caplog):
    reopenings = Reopenings()
    started = asyncio.Event()

    async def hangs():
        started.set()
        await asyncio.Event().wait()

    async def fails():
        raise ValueError("bad resume reply")

    hung = asyncio.create_task(hangs())
    reopenings.adopt("r0", hung, "why r0")
    reopenings.adopt("r1", asyncio.create_task(fails()), "why r1")
    await started.wait()
    with caplog.at_level(logging.ERROR):
        await reopenings.aclose()
    assert hung.cancelled() and reopenings.running() == {}
    assert "reopening r1 after it left a snapshot failed (why r1): ValueError: bad resume reply" in caplog.text
    assert "r0" not in caplog.text


# ----------------------------------------------------------------------------- the coordinator driving rounds
class HungReplicaShardSet:
    """A fake of ``NemoGymShardSet``'s checkpoint side (isolates the coordinator from Ray and the
    servers): ``nemo_gym/replica-0`` prepares at once; ``nemo_gym/replica-1`` never answers its
    prepare (its servers answer each probe, one busy) and its resumes raise ``resume_error``, or
    wait for ``resume_hold``."""

    recovering: set[str] = set()  # no replica is being recovered in-run
    control_handles: dict[str, object] = {}  # calls go through ``send_checkpoint``

    def __init__(self, resume_error: BaseException | None = None, resume_hold: asyncio.Event | None = None):
        self.resume_error = resume_error
        self.resume_hold = resume_hold
        self.sent: list[tuple[str, object]] = []
        self.prepare_policy_overrides: dict[str, dict] = {}
        self.unhealthy: dict[str, str] = {}
        self.placement: dict[str, dict] = {}

    @property
    def checkpoint_handles(self) -> dict[str, object]:
        return {"nemo_gym/replica-0": None, "nemo_gym/replica-1": None}

    def mark_unhealthy(self, iid: str, why: str) -> None:
        self.unhealthy[iid] = why

    def mark_healthy(self, iid: str) -> None:
        self.unhealthy.pop(iid, None)

    def send_checkpoint(self, iid: str, request):
        from gym_patches.checkpoint.calls import PrepareCall, ProbeCall, RenewCall, ResumeCall

        self.sent.append((iid, request))

        async def answer():
            if isinstance(request, PrepareCall):
                if iid == "nemo_gym/replica-1":
                    await asyncio.Event().wait()  # hung until the coordinator cancels it
                return PrepareResult(prepared=True)
            if isinstance(request, ProbeCall):
                return ANSWERS
            if isinstance(request, ResumeCall):
                if iid == "nemo_gym/replica-1" and self.resume_error is not None:
                    raise self.resume_error
                if iid == "nemo_gym/replica-1" and self.resume_hold is not None:
                    await self.resume_hold.wait()
                return {}
            assert isinstance(request, RenewCall), f"not a checkpoint request: {request!r}"
            return {}

        return answer()

    def kinds(self, iid: str) -> list[str]:
        return [type(r).__name__ for i, r in self.sent if i == iid]


async def test_a_hung_replica_leaves_its_snapshot_is_reopened_and_a_failed_reopening_is_logged(caplog):
    import ray

    from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator

    shards = HungReplicaShardSet(resume_error=ray.exceptions.RayActorError())
    coordinator = GymCheckpointCoordinator(shards, prepare_timeout_s=30.0, restart_only_policy="block",
                                           park_grace_s=0.2)
    async with coordinator.prepared("c1") as prepared:
        assert prepared.instance_ids == ["nemo_gym/replica-0"]
        why = prepared.left_out["nemo_gym/replica-1"]
        assert why.startswith("nemo_gym/replica-1 was not prepared within 0.2s after the other replicas")
        assert "Gym server 'agent' (2 rollouts: r1, r2)" in why  # probed at once when the grace began
    assert shards.unhealthy == {"nemo_gym/replica-1": why}
    assert shards.kinds("nemo_gym/replica-0") == ["PrepareCall", "ResumeCall"]
    assert shards.kinds("nemo_gym/replica-1")[0] == "PrepareCall" and "ResumeCall" in shards.kinds("nemo_gym/replica-1")

    # Its reopening raised (its actor is gone): the next prepare reads that error and logs it, naming
    # the replica, instead of dropping it; then asks the replica again (which still hangs: it leaves).
    with caplog.at_level(logging.ERROR):
        async with coordinator.prepared("c2") as prepared:
            assert set(prepared.left_out) == {"nemo_gym/replica-1"}
    assert "reopening nemo_gym/replica-1 after it left a snapshot failed" in caplog.text
    assert "GymReplicaLost" in caplog.text
    await coordinator.aclose()


async def test_a_replica_still_reopening_sits_the_next_snapshot_out_and_aclose_stops_it():
    from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator

    shards = HungReplicaShardSet(resume_hold=asyncio.Event())  # the left replica's resume takes a while
    coordinator = GymCheckpointCoordinator(shards, prepare_timeout_s=30.0, restart_only_policy="block",
                                           park_grace_s=0.2)
    async with coordinator.prepared("c1") as prepared:
        why = prepared.left_out["nemo_gym/replica-1"]
    async with coordinator.prepared("c2") as prepared:
        assert prepared.left_out == {
            "nemo_gym/replica-1": f"nemo_gym/replica-1 is still being reopened after it left a snapshot: {why}"}
        assert prepared.instance_ids == ["nemo_gym/replica-0"]
    await coordinator.aclose()
    assert coordinator._reopenings.running() == {}
