"""Waiting, in async tests, for what happens in other processes or on other tasks: bounded, and
failing the test with what was awaited."""

from __future__ import annotations

import asyncio
import inspect
import time

WAIT_S = 15.0


async def until(what: str, check, timeout_s: float = WAIT_S, interval_s: float = 0.05):
    """Until `check()` (a plain or an async function) returns something true, which is returned;
    fails the test, naming `what`, after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(interval_s)
