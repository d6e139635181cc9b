"""The generation worker as a supervised part (docs/design.md §5.12).

Watched by asking it for its stats every ``PING_EVERY_S``: ``RayActorError`` is a dead process; no answer
within ``hung_after_s`` is a stopped or wedged one (Ray still calls it alive; only its event loop can say).
Its successor is ``RayGenerationBackend.restart``: the old worker killed and its process tree awaited gone,
a new one on the same port with the trainer's weights as they are now, every wait bounded by the recovery's
deadline. Its lost work is not the controller's to bring back: Gym's model servers send their calls again
until the port answers (``policy_unreachable_retry_s``), at ``prefix`` level from the newest cut of each; the
row says how many came back, and which rollouts still went to their prompt meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import threading
import time
from typing import Any

import ray

from gym_patches.utils.cancellation import outlast_cancellation
from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.recovery.records import Loss, RecoveryRecord
from nemo_rl.algorithms.single_controller_utils.recovery.supervisor import RecoveryFailed, took
from nemo_rl.models.generation.worker_log import log_tail

logger = logging.getLogger(__name__)
PING_EVERY_S = 0.5  # how often the worker is asked for its stats (a dead one is noticed within this)
FIRST_RESEND_WAIT_S = 15.0  # how long the row waits for the first re-sent call (model servers retry every <= 1 s)
RESENDS_SETTLED_S = 2.0  # ... then until no call has come again for this long
STATS_EVERY_S = 0.2


def actor_death(exc: BaseException) -> str:
    """What Ray says of a dead actor, in a few words: its pid and the exit type Ray recorded."""
    text = str(exc)
    pid = re.search(r"\bpid: (\d+)", text)
    kind = re.search(r"Worker exit type: (\w+)", text)
    parts = [f"pid {pid.group(1)}" if pid else None, f"Ray's exit type {kind.group(1)}" if kind else None]
    return ", ".join(p for p in parts if p) or (text.strip().splitlines() or [type(exc).__name__])[0][:200]


class GenerationWorkerPart:
    """The policy's generation worker (a ``RayGenerationBackend``)."""

    kind = "generation"
    name = "generation"
    label = "the generation worker"

    def __init__(self, settings: InRunRecoveryConfig, backend: Any, trainer: Any):
        self.settings = settings
        self.backend = backend  # ``worker``, ``restart``, ``log_path``, ``actor_class``, ``starts``
        self.trainer = trainer
        backend.restart_wait_s = settings.timeout_s  # a refit that met a dead worker waits this long
        self.lost: Loss | None = None
        self._last_answer = time.time()  # wall clock: rollouts sent to their prompt after it count
        self._alive_until = 0.0
        self._to_prompt: collections.deque[tuple[float, str]] = collections.deque()  # (wall clock, rollout id)

    @property
    def worker_name(self) -> str:
        return f"generation worker ({self.backend.backend}, ray::{self.backend.actor_class})"

    def went_to_prompt(self, rollout_id: str) -> None:
        """The controller sent ``rollout_id`` back to its prompt (an infrastructure failure): a recovery meant to
        spare it names it in ``restarted_from_prompt``."""
        now = time.time()
        self._to_prompt.append((now, rollout_id))
        while self._to_prompt and now - self._to_prompt[0][0] > self.settings.window_s:
            self._to_prompt.popleft()

    async def watch(self) -> Loss:
        worker, incarnation = self.backend.worker, self.backend.starts
        while True:
            try:
                await asyncio.wait_for(worker.get_stats.remote(), self.settings.hung_after_s)
            except ray.exceptions.RayActorError as exc:
                cause = f"died ({actor_death(exc)})"
                break
            except TimeoutError:
                cause = f"did not answer for {self.settings.hung_after_s:g} s (stopped or wedged; killed)"
                break
            self._last_answer = time.time()
            await asyncio.sleep(PING_EVERY_S)
        self._alive_until = self._last_answer
        self.lost = Loss(self.name, "generation", cause, "watch", incarnation, log=self.backend.log_path)
        return self.lost

    async def replace(self, loss: Loss, deadline: float) -> str:
        """``backend.restart`` in a thread (Ray's calls block) that ends by the deadline, or at once when this
        is cancelled (the run stops, or the supervisor's bound on the start): it is awaited either way, so it
        never outlives the recovery."""
        stop = threading.Event()
        thread = asyncio.get_running_loop().run_in_executor(
            None, lambda: self.backend.restart(self.trainer, deadline, stop.is_set))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            stop.set()
            await outlast_cancellation(thread)
            if not thread.cancelled():
                thread.exception()  # read: its TimeoutError is the cancellation's doing
            raise
        return "restarted"

    async def give_up(self, loss: Loss, why: str, record: RecoveryRecord) -> None:
        tail = log_tail(loss.log).rstrip() or "(empty)"
        where = f"; its log {loss.log}, last lines:\n{tail}" if loss.log else ""
        starts = (f", and {len(record.failed_starts)} new worker(s) did not start (the last: "
                  f"{record.failed_starts[-1]})") if record.failed_starts else ""
        raise RecoveryFailed(f"the {self.worker_name} {loss.cause}{starts}; it is given up: {why}; the run stops"
                             f"{where}")

    async def resume(self, loss: Loss, record: RecoveryRecord) -> None:
        """Nothing to install: the model servers send their calls again by themselves."""
        record.worker, record.log = f"ray::{self.backend.actor_class}", loss.log
        self.lost = None

    async def settle(self, loss: Loss, record: RecoveryRecord) -> None:
        """Until the calls sent again have come (the first within ``FIRST_RESEND_WAIT_S``, then none for
        ``RESENDS_SETTLED_S``); the row then counts them, and which rollouts still went to their prompt."""
        try:
            await self._resent_calls(loss, record)
        finally:
            record.restarted_from_prompt = sorted({r for t, r in self._to_prompt if t >= self._alive_until})

    async def _resent_calls(self, loss: Loss, record: RecoveryRecord) -> None:
        worker = self.backend.worker
        loop = asyncio.get_running_loop()
        began = since = loop.time()
        seen = 0
        while True:
            try:
                stats = await asyncio.wait_for(worker.get_stats.remote(), self.settings.hung_after_s)
            except (ray.exceptions.RayActorError, TimeoutError):
                return  # lost again: its watch has it
            read_at = time.monotonic()
            record.calls_resent = stats.get("resent_calls", 0)
            record.calls_continued_from_cut = stats.get("resent_from_cut", 0)
            record.tokens_kept = stats.get("resent_cut_tokens", 0)
            age = stats.get("first_resent_age_s")
            if age is not None and record.seconds_to_redispatch is None:
                # the worker's age of its first re-sent call, read against this clock: one clock, no skew
                record.seconds_to_redispatch = round(max(0.0, read_at - age - loss.noticed), 3)
            now = loop.time()
            if record.calls_resent != seen:
                seen, since = record.calls_resent, now
            if (seen == 0 and now - began > FIRST_RESEND_WAIT_S) or (seen and now - since > RESENDS_SETTLED_S):
                return
            await asyncio.sleep(STATS_EVERY_S)

    def line(self, record: RecoveryRecord) -> str:
        if record.action == "given_up":
            return f"the {self.worker_name} {record.cause}: given up ({record.given_up}); the run stops"
        return (f"recovered the {self.worker_name}: {record.cause}; restarted{took(record)}; {record.calls_resent} "
                f"model calls sent again, {record.calls_continued_from_cut} from a generation cut "
                f"({record.tokens_kept} tokens kept), {len(record.restarted_from_prompt)} rollouts restart from "
                "the prompt")

    def gauges(self) -> dict[str, float]:
        """Upstream's generation-fleet gauges, for the one worker (shard 0)."""
        serving = getattr(self.backend, "_serving", (None, None))[1]
        out = {"gen_fleet/serving_shards": 0.0 if self.lost is not None else 1.0,
               "gen_fleet/restart_attempts/0": float(max(0, self.backend.starts - 1))}
        if serving is not None:
            out["gen_fleet/shard_weight_version/0"] = float(serving)
        return out
