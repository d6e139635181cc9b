"""The prefix level is decided per rollout (docs/design.md §5.10): under ``target_level: prefix`` an agent
overridden to ``turn`` never has its calls cut; a prefix-level agent's calls are.

Real parts from the ledger to the backend: the ledger's levels come from the real config's
``resolve_for``; the real ``StagedStager.hold`` builds the prepare and the real
``GymCheckpointCoordinator`` sends it, through the coordination library over loopback HTTP, to the
model server's real control plane and ``PolicyModelParticipant``, whose real ``BackendCuts`` pins and
fetches over HTTP from a small aiohttp backend (a named fake of the generation backend: it answers the
cut routes from a table). The persist after resume says which calls were cut.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gym_patches.checkpoint.storage import FileSystemWriter
from gym_patches.checkpoint.calls import PersistCall, PrepareCall
from gym_patches.checkpoint.coordination import ControlClient, Participant, Participants, call
from gym_patches.checkpoint.cuts import (
    CUT_FETCH_ROUTE,
    CUT_ROUTE,
    CutReply,
    CutRequest,
    FetchRequest,
    GenerationCut,
    PinReply,
)
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import PolicyModelParticipant
from gym_patches.checkpoint.wire import StatusReply
from gym_patches.responses_api_models.vllm_model.app import BackendCuts
from nemo_rl.algorithms.single_controller_utils.config import RolloutRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import DispatchGate, LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator, PrepareAsk
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.generation_cut_scope import prefix_rollouts
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.inputs import SnapshotInputs
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import StagedStager
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.run_hooks import RunHooks
from tests.unit.test_control_plane import TOKEN, start
from tests.unit.test_model_cuts import _generating  # one call per key, parked in the backend

IID = "nemo_gym/replica-0"
TOKENS = [7, 8, 9]  # what the backend has decoded for every call


class TableBackend:
    """A named fake generation backend: ``/ng-cuts`` pins every named call at ``TOKENS``, fetch returns them."""

    def __init__(self) -> None:
        self.pinned: dict[str, list[str]] = {}

    async def pin(self, request: web.Request) -> web.Response:
        body = CutRequest.model_validate(await request.json())
        self.pinned[body.pin] = list(body.call_ids)
        return web.json_response(PinReply(counts={c: len(TOKENS) for c in body.call_ids}).model_dump())

    async def fetch(self, request: web.Request) -> web.Response:
        body = FetchRequest.model_validate(await request.json())
        cuts = {c: GenerationCut.build(c, "a" * 64, TOKENS, [-0.5] * len(TOKENS), 1)
                for c in self.pinned.pop(body.pin, [])}
        return web.json_response(CutReply(cuts=cuts).model_dump(mode="json"))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1" + CUT_ROUTE, self.pin)
        app.router.add_post("/v1" + CUT_FETCH_ROUTE, self.fetch)
        return app


class OneReplica:
    """The shard set as the coordinator sees it: one replica whose checkpoint calls go to the coordination
    library (what the Gym actor runs) over HTTP."""

    recovering: set[str] = set()  # no replica is being recovered in-run
    control_handles: dict[str, object] = {}  # calls go through ``send_checkpoint``

    def __init__(self, participants: Participants):
        self.participants = participants
        self.prepare_policy_overrides: dict = {}
        self.restart_only_servers: dict = {}
        self.sent: list = []

    @property
    def checkpoint_handles(self) -> dict[str, object]:
        return {IID: None}

    def mark_healthy(self, iid: str) -> None:
        pass

    def mark_unhealthy(self, iid: str, why: str) -> None:
        raise AssertionError(f"{iid} left the snapshot: {why}")

    def send_checkpoint(self, iid: str, request):
        self.sent.append(request)
        return call(self.participants, request)


def _ledger() -> tuple[RolloutRecoveryLedger, dict[str, list[str]]]:
    """Two groups of two under ``target_level: prefix``, the ``plain`` agent overridden to ``turn``, all
    dispatched on one replica; agent -> capture keys."""
    levels = RolloutRecoveryConfig(target_level="prefix", agent_target_level_overrides={"plain": "turn"})
    ledger = RolloutRecoveryLedger()
    for i, agent in enumerate(("deep", "plain")):
        ledger.reserve_group(f"g{i}", f"p{i}", i, None, agent, levels.resolve_for(None, agent), 2, 1, position=i)
    keys: dict[str, list[str]] = {"deep": [], "plain": []}
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, IID)
        keys[ledger.groups[req.group_id].agent_name].append(req.rollout_id)
    return ledger, keys


def test_the_cut_scope_names_only_prefix_level_rollouts_and_nothing_when_all_are():
    ledger, keys = _ledger()
    assert prefix_rollouts(ledger) == {IID: sorted(keys["deep"])}
    everyone = RolloutRecoveryLedger()
    everyone.reserve_group("g0", "p0", 0, None, "deep", "prefix", 2, 1, position=0)
    for req in everyone.reserved_attempts():
        everyone.mark_dispatched(req.rollout_id, IID)
    assert prefix_rollouts(everyone) is None  # every call in flight: no list in the pause
    # the wire: an older caller's prepare (no list) still reads; a list without a cut is refused
    assert PrepareAsk(capture=True).fields_for(IID) == {"capture": True, "cut": False, "cut_rollouts": None}
    with pytest.raises(ValueError, match="cut_rollouts is given without cut"):
        PrepareCall(checkpoint_id="c1", deadline_ts=time.time() + 5, cut_rollouts=["r1"])


async def test_an_agent_overridden_to_turn_under_a_prefix_target_is_never_cut(tmp_path: Path):
    ledger, keys = _ledger()
    backend_server = TestServer(TableBackend().app(), host="127.0.0.1")
    await backend_server.start_server()
    session = aiohttp.ClientSession()
    model = PolicyModelParticipant()
    model.cut_source = BackendCuts(SimpleNamespace(  # the model server's fields BackendCuts reads
        name="policy_model", _session=session,
        global_config=SimpleNamespace(policy_base_url=str(backend_server.make_url("/v1")), policy_api_key="k")))
    harness = await start(model, instance="policy_model")  # type: ignore[arg-type]
    release, calls = await _generating(model, keys["deep"] + keys["plain"])
    try:
        control = ControlClient(session, TOKEN)
        url = str(harness.client.make_url(""))
        status = StatusReply.model_validate(await control.get("policy_model", url, "status", timeout_s=5))
        shards = OneReplica(Participants([Participant("policy_model", "model", url, status)], control))
        coordinator = GymCheckpointCoordinator(shards, prepare_timeout_s=10.0, restart_only_policy="block")
        changes = LedgerChanges()
        inputs = SnapshotInputs(ledger, DataPlaneStore(), PromptDataloader([{"id": 0}], seed=0), lambda: 0,
                                lambda: 0, lambda: tmp_path, generation_cuts=True)
        stager = StagedStager(inputs, RunHooks(), coordinator, DispatchGate(changes), changes, RunStore(tmp_path, FileSystemWriter(), keep_latest_k=1))

        async with stager.hold("c1") as prepared:
            cut = prepared.results[IID].replies["policy_model"].cut
            assert cut is not None and (cut.in_flight, cut.error) == (2, None)  # deep's two calls only
        asked = [r for r in shards.sent if isinstance(r, PrepareCall)]
        assert [sorted(r.cut_rollouts) for r in asked] == [sorted(keys["deep"])]

        scope = [EpisodeId.from_capture_key(k) for k in keys["deep"] + keys["plain"]]
        persisted = await call(shards.participants, PersistCall(
            checkpoint_id="c1", deadline_ts=time.time() + 10, checkpoint_dir=str(tmp_path / "gym"),
            episode_ids=scope))
        reply = persisted["policy_model"]
        assert sorted(reply.episode_ids) == sorted(keys["deep"] + keys["plain"])  # all saved at turn level
        assert reply.cut_tokens == {k: len(TOKENS) for k in keys["deep"]}  # only the prefix-level ones cut
        assert (reply.cut_failed, reply.cut_error) == (0, None)
    finally:
        release.set()
        await asyncio.gather(*calls)
        await harness.client.close()
        await session.close()
        await backend_server.close()
