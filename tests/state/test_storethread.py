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


class Gated(MemoryStore):
    """A store whose every ping waits for its turn."""

    def __init__(self) -> None:
        super().__init__(bytes_per_token=1, block_tokens=512)
        self.turns = threading.Semaphore(0)

    def ping(self) -> None:
        assert self.turns.acquire(timeout=10), "no turn given"


def test_a_caller_gets_the_probe_it_waited_on_when_the_next_has_begun() -> None:
    # /readyz and the probing loop share probes: once one ends, the first to look starts the
    # next, possibly before a caller that waited on the ended one has resumed.
    store = Gated()
    health = StoreHealth(store, offload=True)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        looping = asyncio.ensure_future(health.refresh(None))
        await asyncio.sleep(0)
        probing = health._probing
        assert probing is not None
        started: list[asyncio.Task[object]] = []
        # Runs before the waiting caller below resumes: its callback comes after this one.
        probing.add_done_callback(lambda _: started.append(loop.create_task(health.refresh(5.0))))
        waiting = asyncio.ensure_future(health.refresh(5.0))
        await asyncio.sleep(0)
        store.turns.release()
        snapshot = await waiting
        assert snapshot is not None and snapshot.ok
        assert health._probing is not probing  # the next probe had begun meanwhile
        store.turns.release()
        assert (await started[0]) is not None and (await looping) is not None

    try:
        asyncio.run(scenario())
    finally:
        health.close()
