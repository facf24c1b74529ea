"""The store thread and the store's background health (app/state/storethread.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from app.core.errors import StoreUnavailable
from app.state import MemoryStore
from app.state.storethread import StoreHealth, StoreThread


def test_without_offload_a_job_runs_inline_on_the_loop() -> None:
    thread = StoreThread(offload=False)

    async def scenario() -> tuple[int, int]:
        return await thread.run(threading.get_ident), threading.get_ident()

    ran_on, loop_on = asyncio.run(scenario())
    assert ran_on == loop_on


def test_jobs_queued_behind_an_unavailable_store_are_refused_without_touching_it() -> None:
    thread = StoreThread(offload=True)
    release = threading.Event()
    calls: list[str] = []

    def hung() -> None:
        release.wait(10)
        calls.append("hung")
        raise StoreUnavailable("timed out")

    def job(name: str) -> str:
        calls.append(name)
        return name

    async def scenario() -> list[Any]:
        first = asyncio.ensure_future(thread.run(hung))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(thread.run(job, "queued"))
        needs_no_store = asyncio.ensure_future(thread.run(job, "drain", fail_fast=False))
        await asyncio.sleep(0.05)
        release.set()
        answers = await asyncio.gather(first, queued, needs_no_store, return_exceptions=True)
        answers.append(await thread.run(job, "later"))  # submitted after the failure: it runs
        return answers

    try:
        answers = asyncio.run(scenario())
    finally:
        thread.close()
    assert isinstance(answers[0], StoreUnavailable) and isinstance(answers[1], StoreUnavailable)
    assert str(answers[1]) == "timed out"  # the store's own answer, given once more
    assert answers[2:] == ["drain", "later"]
    assert calls == ["hung", "drain", "later"]


def test_run_within_answers_when_the_job_is_late_and_the_job_still_runs() -> None:
    thread = StoreThread(offload=True)
    release, done = threading.Event(), threading.Event()

    def slow() -> str:
        release.wait(10)
        done.set()
        return "late"

    async def scenario() -> tuple[bool, Any, float]:
        answer = await thread.run_within(0.05, slow)
        stuck = thread.stuck_seconds()
        release.set()
        return (*answer, stuck)

    try:
        finished, result, stuck = asyncio.run(scenario())
        assert done.wait(5)
    finally:
        thread.close()
    assert (finished, result) == (False, None) and stuck > 0
    assert thread.stuck_seconds() == 0.0


class Flaky(MemoryStore):
    def __init__(self) -> None:
        super().__init__(bytes_per_token=1, block_tokens=512)
        self.down = False
        self.hang = threading.Event()

    def ping(self) -> None:
        if self.hang.is_set():  # a store that does not answer for a while
            time.sleep(0.5)
        if self.down:
            raise StoreUnavailable("refused")


@pytest.mark.parametrize("offload", [False, True])
def test_health_keeps_the_last_counts_when_the_store_is_down(offload: bool) -> None:
    store = Flaky()
    health = StoreHealth(store, offload=offload)

    async def scenario() -> None:
        up = await health.refresh(1.0)
        assert up is not None and up.ok and up.stats["sessions"] == 0
        store.down = True
        down = await health.refresh(1.0)
        assert (
            down is not None
            and not down.ok
            and down.stats == up.stats
            and down.stats_at == up.stats_at
        )

    try:
        asyncio.run(scenario())
    finally:
        health.close()


def test_a_probe_that_does_not_answer_in_time_is_none_and_last_stays() -> None:
    store = Flaky()
    health = StoreHealth(store, offload=True)

    async def scenario() -> None:
        assert (await health.refresh(1.0)) is not None
        store.hang.set()
        assert await health.refresh(0.05) is None
        assert health.last.ok  # what it said before

    try:
        asyncio.run(scenario())
    finally:
        health.close()
