"""Every background task has an owner that ends it: the model's cut pin ends with the server's control plane,
the lease watcher's stop never swallows its caller's cancellation, and the torch generation worker's
batcher has ended once ``stop`` returns."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gym_patches.checkpoint.control.lease import Lease, LeaseWatcher
from gym_patches.checkpoint.model import PolicyModelParticipant
from tests.unit.test_control_plane import TOKEN, own_tasks, start
from tests.unit.test_model_cuts import FakeCutBackend, _generating


def _others() -> list[asyncio.Task]:
    """Every task not ended, this test's own aside."""
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


async def test_the_cut_pin_ends_with_the_control_plane_that_started_it():
    model = PolicyModelParticipant()
    model.cut_source = backend = FakeCutBackend({"r1.c": [1, 2]}, hang=True)  # the pin never answers
    model.cut_timeout_s = 3600.0
    release, calls = await _generating(model, ["r1"])
    h = await start(model, instance="model_a")  # type: ignore[arg-type]
    await h.ok("prepare", checkpoint_id="c1", cut=True)
    await h.ok("resume", checkpoint_id="c1")
    while not backend.asked:  # the pin has reached the backend, where it hangs
        await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*calls)
    pins = [t for t in own_tasks() if "cut-pin" in t.get_name()]
    assert len(pins) == 1
    await h.client.close()  # stops the control plane
    assert pins[0].cancelled()
    assert own_tasks() == [] and _others() == []


async def test_stopping_the_lease_watcher_never_swallows_the_callers_cancellation():
    async def never() -> None:
        raise AssertionError("the lease has not run out")

    watcher = LeaseWatcher(Lease(10.0, time.time), never, "model_a")
    watcher.start()
    await asyncio.sleep(0)  # the watcher waits for a lease
    stopper = asyncio.create_task(watcher.stop())
    await asyncio.sleep(0)  # the stopper has cancelled the watcher and waits for it to end
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert stopper.cancelled() and not watcher.running and own_tasks() == []


async def test_the_torch_worker_has_no_task_left_once_stopped(tmp_path):
    from nemo_rl.algorithms.grpo_config import GenerationConfig, PolicyConfig
    from nemo_rl.models.generation.worker import GenerationServer
    from tests.model_fixtures import tiny_qwen_dir

    threads = torch.get_num_threads()
    cfg = PolicyConfig(device="cpu", max_seq_len=64, generation=GenerationConfig(max_new_tokens=4))
    server = GenerationServer(cfg, str(tiny_qwen_dir(tmp_path)), model_name="tiny")
    try:
        await server.start()
        out = await server.generate([1, 2, 3], 2, 1.0)  # the batcher has served a batch
        assert len(out["token_ids"]) >= 1
        await server.stop()
        assert _others() == []
    finally:
        torch.set_num_threads(threads)
