"""A Gym server's automatic garbage collection stays young and its full walks run on a timer, never
while the collector is held (``gym_patches/utils/collector.py``; docs/design.md §4.5, "Paced turns").

The heap test runs in a child process of its own (collector thresholds are process-wide): a heap
that grows the way a replica's does while it admits a step (long-lived containers, no cycles), with
``gc.callbacks`` counting the collections of each generation.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap

import pytest

from gym_patches.utils.collector import CollectorHold, FullCollections, restore_collections, young_collections_only

GROWING_HEAP = textwrap.dedent("""
    import gc, json, sys
    from gym_patches.utils.collector import young_collections_only
    if sys.argv[1] == "young":
        young_collections_only()
    generations = {0: 0, 1: 0, 2: 0}
    gc.callbacks.append(lambda phase, info: phase == "start" and generations.__setitem__(
        info["generation"], generations[info["generation"]] + 1))
    kept = []
    for i in range(400_000):  # rollouts' state: small dicts and lists that stay alive
        kept.append({"turn": i, "items": [i, str(i)]})
    print(json.dumps({"generations": generations, "threshold": list(gc.get_threshold())}))
""")


def _collections(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", GROWING_HEAP, mode], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)


def test_a_growing_heap_gets_young_collections_only():
    default, young = _collections("default"), _collections("young")
    assert default["generations"]["2"] > 0, default  # the scenario trips full walks by default
    assert young["generations"]["2"] == 0, young
    assert young["generations"]["0"] > 0 and young["generations"]["1"] > 0, young  # young cycles still found
    assert young["threshold"][:2] == default["threshold"][:2]  # generations 0 and 1 as before


async def test_full_collections_run_on_their_timer_skip_while_held_and_stop():
    collections = FullCollections(interval_s=0.02)
    collections.start()
    try:
        while collections.runs < 2:
            await asyncio.sleep(0.01)
        hold = CollectorHold()
        hold.hold()
        try:
            runs = collections.runs
            while collections.skipped < 2:
                await asyncio.sleep(0.01)
            assert collections.runs == runs  # held: rollouts are held, no walk now
        finally:
            hold.release()
        while collections.runs == runs:
            await asyncio.sleep(0.01)
    finally:
        await collections.stop()
    stopped_at = collections.runs
    await asyncio.sleep(0.1)
    assert collections.runs == stopped_at  # stopped: its task is gone
    assert gc.isenabled()


async def test_stopping_never_swallows_the_callers_cancellation():
    collections = FullCollections(interval_s=3600)
    collections.start()
    await asyncio.sleep(0)  # the loop sleeps until its first round
    stopper = asyncio.create_task(collections.stop())
    await asyncio.sleep(0)  # the stopper has cancelled the loop and waits for it to end
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert stopper.cancelled() and collections.runs == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "full gc collections" and not t.done()]


@pytest.mark.parametrize("bad", [0, -1.0])
def test_the_interval_must_be_positive(bad):
    with pytest.raises(ValueError, match="interval_s"):
        FullCollections(interval_s=bad)


def test_young_only_is_counted_and_the_last_holder_restores_the_thresholds():
    before = gc.get_threshold()
    young_collections_only()  # two servers in one process (as in tests)
    young_collections_only()
    try:
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 10**9
        restore_collections()
        assert gc.get_threshold()[2] > 10**9  # one holder left
    finally:
        restore_collections()
    assert gc.get_threshold() == before
