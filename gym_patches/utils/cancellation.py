"""Ending a task without losing the caller's cancellation.

A stop that cancels a task and waits for it must not swallow a cancellation aimed at the caller while it
waits (``contextlib.suppress(CancelledError)`` around the wait does): the caller's own cancel would be
lost, and the task might still run. ``outlast_cancellation`` waits the task out, then raises it.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def outlast_cancellation(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` however often the waiter is cancelled, then raise the cancellation."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
