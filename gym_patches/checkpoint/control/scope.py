"""Owners for the background work of a checkpoint (docs/design.md §4.4).

A ``TaskScope`` is like a trio nursery or an ``asyncio.TaskGroup``: every task it starts is its
own, and closing it cancels and awaits whatever is left, including a thread a task is waiting on.
Unlike a TaskGroup, a task's outcome outlives the request that started it: a request that goes
away (a dropped connection) does not stop the task, and any later request for the same work gets
its reply or its error. A task's error is logged once, when it happens, and kept as its result, so
none is ever dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from typing import Any, Awaitable, Callable, Generic, Hashable, TypeVar

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.store import WriteStopped
from gym_patches.utils.cancellation import outlast_cancellation

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
TASK_NAME_PREFIX = "checkpoint-"  # every task a control plane starts is named so


class JobFailed(Exception):
    """A job raised something that is not a ``CheckpointError`` (a participant bug). Answered as
    500 ``internal_error``; the scope has already logged it."""

    def __init__(self, name: str, cause: BaseException):
        super().__init__(f"{name} failed: {type(cause).__name__}: {cause}")
        self.name = name
        self.cause = cause


class Job(Generic[T]):
    """One piece of background work: its task, the arguments it was started with (a retry must
    match them) and a stop flag for the parts of it that run off the event loop."""

    def __init__(self, scope: TaskScope, name: str, args: Hashable):
        self.scope = scope
        self.name = name
        self.args = args
        self.stop = threading.Event()  # set when the scope closes; work in a thread checks it
        self.task: asyncio.Task[T] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def result(self) -> T:
        """Wait for the outcome. A waiter that is cancelled leaves the job running; a job the
        scope cancelled answers ``stale_checkpoint``; a failure is raised to every caller."""
        assert self.task is not None
        await asyncio.wait({self.task})
        if self.task.cancelled():
            raise CheckpointError(f"{self.name} was aborted by {self.scope.closed_by}", code="stale_checkpoint")
        error = self.task.exception()
        if error is None:
            return self.task.result()
        if isinstance(error, CheckpointError):
            raise error
        raise JobFailed(self.name, error) from error

    async def in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """``fn`` in a worker thread, owned: if the job is cancelled meanwhile, ``stop`` is set and
        the job ends only once the thread has (``fn`` is expected to check ``stop``)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        future = asyncio.get_running_loop().run_in_executor(None, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.stop.set()
            await outlast_cancellation(future)
            if not future.cancelled() and future.exception() is not None:
                error = future.exception()
                if not isinstance(error, WriteStopped):  # stopping is what was asked for
                    logger.warning("checkpoint control %s: %s was aborted, and its thread then failed: %s: %s",
                                   self.scope.instance, self.name, type(error).__name__, error)
            raise


class TaskScope:
    """The jobs of one lifetime (a checkpoint, from prepare to resume or lease expiry; a capture,
    until a newer one replaces it), by key: one job per key, kept with its outcome until close."""

    def __init__(self, label: str, instance: str):
        self.label = label
        self.instance = instance  # the server, named in every log line
        self.closed_by: str | None = None  # why it closed, for the aborted jobs' answer
        self._jobs: dict[str, Job[Any]] = {}

    @property
    def closed(self) -> bool:
        return self.closed_by is not None

    def get(self, key: str) -> Job[Any] | None:
        return self._jobs.get(key)

    def spawn(self, key: str, name: str, args: Hashable, work: Callable[[Job[T]], Awaitable[T]]) -> Job[T]:
        """Start ``work(job)`` as the job ``key`` (replacing none: ask ``get`` first)."""
        if self.closed:
            raise CheckpointError(f"{name} refused: {self.label} was closed by {self.closed_by}",
                                  code="stale_checkpoint")
        assert key not in self._jobs, f"{self.label} already has a {key} job"
        job: Job[T] = Job(self, name, args)
        job.task = asyncio.create_task(self._run(job, work), name=f"{TASK_NAME_PREFIX}{key}:{self.label}")
        job.task.add_done_callback(_mark_retrieved)
        self._jobs[key] = job
        return job

    async def _run(self, job: Job[T], work: Callable[[Job[T]], Awaitable[T]]) -> T:
        try:
            return await work(job)
        except CheckpointError as exc:
            logger.warning("checkpoint control %s: %s failed: %s", self.instance, job.name, exc.detail)
            raise
        except Exception:
            logger.exception("checkpoint control %s: %s failed", self.instance, job.name)
            raise

    def pending(self) -> list[asyncio.Task[Any]]:
        return [job.task for job in self._jobs.values() if job.task is not None and not job.task.done()]

    async def close(self, reason: str) -> None:
        """Stop every job still running and wait until each has ended (even if this wait is
        cancelled: then it raises only after). Outcomes stay readable; no new job is accepted."""
        if self.closed_by is None:
            self.closed_by = reason
        tasks = self.pending()
        for job in self._jobs.values():
            if job.running:
                job.stop.set()
                assert job.task is not None
                job.task.cancel()
        if tasks:
            await outlast_cancellation(_all_of(tasks))


def _mark_retrieved(task: asyncio.Task[Any]) -> None:
    """The job logged its error and keeps it as its result: asyncio need not report it again."""
    if not task.cancelled():
        task.exception()


def _all_of(tasks: list[asyncio.Task[Any]]) -> asyncio.Future[Any]:
    """A future done once every task is, whatever their outcome (each was logged by its job)."""
    return asyncio.gather(*tasks, return_exceptions=True)
