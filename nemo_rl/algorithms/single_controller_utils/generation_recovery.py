"""In-run recovery of the generation worker (docs/design.md §5.13): a worker that dies or wedges is replaced
inside the run, and the model calls that were on it are sent again, so no rollout fails for it.

Supervision: the worker is asked for its stats every ``PING_EVERY_S``. ``RayActorError`` means its process
is gone; no answer within ``rollout_recovery.in_run.hung_after_s`` means it is stopped or wedged (Ray still
calls it alive: only its event loop can say). Either is one recovery:

1. ``RayGenerationBackend.restart``: the old actor is killed and awaited dead, and a new one starts on the
   same port with the trainer's weights as they are now (read under the trainer's step lock), so the
   version it serves is the trainer's and the refit check holds; a refit that met the dead worker waits
   for this and ships nothing more;
2. Gym's model servers, which kept sending their calls again while the port was closed
   (``policy_unreachable_retry_s``), reach the new worker: same call id, and at ``prefix`` level the newest
   cut of the call a snapshot fetched, so only the tail is decoded again; the agents see a slower reply;
3. one line on stderr and a ``recoveries.jsonl`` row (``part: generation``) once the re-sent calls have
   arrived: how many, how many continued from a cut and the tokens kept, the rollouts that still went back
   to their prompt, and the seconds from the loss to the first re-sent call.

Bounded like the Gym recovery: a start that fails counts as one more recovery; ``max_recoveries`` within
``window_s``, or a start not done within ``timeout_s``, stops the run with one ``error:`` naming the worker
and its log.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.models.generation.worker_log import log_tail

logger = logging.getLogger(__name__)
PING_EVERY_S = 0.5  # how often the worker is asked for its stats (a dead one is noticed within this)
FIRST_RESEND_WAIT_S = 15.0  # how long the row waits for the first re-sent call (model servers retry every <= 1 s)
RESENDS_SETTLED_S = 2.0  # ... then until no call has come again for this long


class GenerationRecoveryFailed(RuntimeError):
    """The generation worker could not be recovered within the bounds: the run stops (one ``error:`` line)."""


@dataclass
class WorkerLoss:
    """The worker lost, as noticed."""

    cause: str
    log: str | None  # the lost worker's own log
    noticed: float = field(default_factory=time.monotonic)
    at: float = field(default_factory=time.time)
    alive_until: float = 0.0  # wall clock of its last answer: rollouts sent to their prompt after it count
    failed_starts: list[str] = field(default_factory=list)  # why each new worker that did not start failed


def actor_death(exc: BaseException) -> str:
    """What Ray says of a dead actor, in a few words: its pid and the exit type Ray recorded."""
    text = str(exc)
    pid = re.search(r"\bpid: (\d+)", text)
    kind = re.search(r"Worker exit type: (\w+)", text)
    parts = [f"pid {pid.group(1)}" if pid else None, f"Ray's exit type {kind.group(1)}" if kind else None]
    return ", ".join(p for p in parts if p) or (text.strip().splitlines() or [type(exc).__name__])[0][:200]


class GenerationWorkerRecovery:
    """Owns the worker's watch and its recoveries; ``run`` is a task of the controller's group."""

    def __init__(self, settings: InRunRecoveryConfig, backend: Any, trainer: Any, records: RunRecords):
        self.settings = settings
        self.backend = backend  # a RayGenerationBackend: ``worker``, ``restart``, ``log_path``, ``actor_class``
        self.trainer = trainer
        self.records = records
        self.count = 0
        self._history: collections.deque[float] = collections.deque()  # when each recovery began
        self._to_prompt: collections.deque[tuple[float, str]] = collections.deque()  # (wall clock, rollout id)
        self._last_answer = time.time()

    @property
    def worker_name(self) -> str:
        return f"generation worker ({self.backend.backend}, ray::{self.backend.actor_class})"

    def went_to_prompt(self, rollout_id: str) -> None:
        """The controller sent ``rollout_id`` back to its prompt (an infrastructure failure): a recovery that
        was meant to spare it names it in ``restarted_from_prompt``."""
        now = time.time()
        self._to_prompt.append((now, rollout_id))
        while self._to_prompt and now - self._to_prompt[0][0] > self.settings.window_s:
            self._to_prompt.popleft()

    # -- the task
    async def run(self) -> None:
        """Watch the worker and recover it, one loss at a time, until cancelled."""
        self.backend.restart_wait_s = self.settings.timeout_s  # a refit that met a dead worker waits this long
        async with asyncio.TaskGroup() as rows:
            while True:
                loss = await self._watch()
                start_s = await self._restart(loss)
                self.count += 1
                rows.create_task(self._report(loss, start_s), name="generation-recovery-row")

    async def _watch(self) -> WorkerLoss:
        worker, log = self.backend.worker, self.backend.log_path
        while True:
            try:
                await asyncio.wait_for(worker.get_stats.remote(), self.settings.hung_after_s)
            except ray.exceptions.RayActorError as exc:
                return WorkerLoss(f"died ({actor_death(exc)})", log, alive_until=self._last_answer)
            except TimeoutError:
                return WorkerLoss(f"did not answer for {self.settings.hung_after_s:g} s (stopped or wedged; killed)",
                                  log, alive_until=self._last_answer)
            self._last_answer = time.time()
            await asyncio.sleep(PING_EVERY_S)

    async def _restart(self, loss: WorkerLoss) -> float:
        """A new worker in the old one's place; a start that fails is tried again until the bound."""
        logger.warning("the %s %s; restarting it", self.worker_name, loss.cause)
        while True:
            self._check_bound(loss)
            self._history.append(time.monotonic())
            started = time.monotonic()
            try:
                # The restart runs in a thread (Ray's calls block) bounded by the same time, so the thread ends
                # too; a start past the bound stops the run.
                await asyncio.wait_for(asyncio.to_thread(self.backend.restart, self.trainer, self.settings.timeout_s),
                                       self.settings.timeout_s + 5.0)
                return round(time.monotonic() - started, 3)
            except TimeoutError:
                raise GenerationRecoveryFailed(self._failure(
                    loss, f"its restart did not finish within {self.settings.timeout_s:g} s "
                          "(rollout_recovery.in_run.timeout_s)")) from None
            except ray.exceptions.RayError as exc:
                failed = actor_death(exc) if isinstance(exc, ray.exceptions.RayActorError) else \
                    (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                logger.warning("the new %s did not start (%s); trying again", self.worker_name, failed)
                loss.failed_starts.append(failed)
                loss.log = self.backend.log_path

    def _check_bound(self, loss: WorkerLoss) -> None:
        while self._history and time.monotonic() - self._history[0] > self.settings.window_s:
            self._history.popleft()
        if len(self._history) >= self.settings.max_recoveries:
            raise GenerationRecoveryFailed(self._failure(
                loss, f"it was recovered {len(self._history)} times within {self.settings.window_s:g} s "
                      f"(rollout_recovery.in_run.max_recoveries={self.settings.max_recoveries})"))

    def _failure(self, loss: WorkerLoss, why: str) -> str:
        tail = log_tail(loss.log).rstrip() or "(empty)"
        where = f"; its log {loss.log}, last lines:\n{tail}" if loss.log else ""
        starts = (f", and {len(loss.failed_starts)} new worker(s) did not start (the last: "
                  f"{loss.failed_starts[-1]})") if loss.failed_starts else ""
        return f"the {self.worker_name} {loss.cause}{starts}; it is given up: {why}; the run stops{where}"

    # -- the row
    async def _report(self, loss: WorkerLoss, start_s: float) -> None:
        """The row and the line once the re-sent calls have come; also when the run ends first (cancelled:
        with what had come by then)."""
        stats: dict[str, Any] = {}
        try:
            await self._resent_calls(stats)
        finally:
            self._write_row(loss, start_s, stats)

    def _write_row(self, loss: WorkerLoss, start_s: float, stats: dict[str, Any]) -> None:
        first = stats.get("first_resent_at")
        row = {
            "time": loss.at, "instance": "generation", "part": "generation", "cause": loss.cause,
            "action": "restarted", "worker": f"ray::{self.backend.actor_class}", "log": loss.log,
            "calls_resent": stats.get("resent_calls", 0),
            "calls_continued_from_cut": stats.get("resent_from_cut", 0),
            "tokens_kept": stats.get("resent_cut_tokens", 0),
            "restarted_from_prompt": sorted({r for t, r in self._to_prompt if t >= loss.alive_until}),
            "seconds_to_redispatch": None if first is None else round(max(0.0, first - loss.at), 3),
            "seconds_to_start": start_s,
        }
        self.records.recovery(row)
        took = f" in {row['seconds_to_redispatch']:.1f} s" if first is not None else ""
        print(f"recovered the {self.worker_name}: {loss.cause}; restarted{took}; {row['calls_resent']} model calls "
              f"sent again, {row['calls_continued_from_cut']} from a generation cut ({row['tokens_kept']} tokens "
              f"kept), {len(row['restarted_from_prompt'])} rollouts restart from the prompt",
              file=sys.stderr, flush=True)

    async def _resent_calls(self, stats: dict[str, Any]) -> None:
        """Fill ``stats`` with the new worker's once the calls sent again have come (none within the wait:
        none was in flight): the first, then until none has come for ``RESENDS_SETTLED_S``."""
        worker = self.backend.worker
        loop = asyncio.get_running_loop()
        began = since = loop.time()
        seen = 0
        while True:
            try:
                stats.update(await asyncio.wait_for(worker.get_stats.remote(), self.settings.hung_after_s))
            except (ray.exceptions.RayActorError, TimeoutError):
                return  # lost again: the watch has it
            now = loop.time()
            if stats.get("resent_calls", 0) != seen:
                seen, since = stats.get("resent_calls", 0), now
            if (seen == 0 and now - began > FIRST_RESEND_WAIT_S) or (seen and now - since > RESENDS_SETTLED_S):
                return
            await asyncio.sleep(0.2)
