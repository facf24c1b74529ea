"""An instance's GPU shared by its running requests, in chunked-prefill steps (the scenario's
`compute = "shared"`).

vLLM (and Sarathi-Serve, which it follows) runs a request's prefill in chunks beside the other
requests' decodes: each scheduler step takes one token from every decoding request and fills the
rest of its token budget (`step_tokens`, vLLM's `max_num_batched_tokens`, 8192 by default for
chunked prefill) with prefill, first come first served; a step takes longer the more prefill it
carries. So a long prefill, or the recompute of a context that left HBM, slows every request
running beside it, which the `independent` model (each request's prefill and decode as if alone
on its GPU) cannot show.

The step time is linear in the prefill tokens it carries: `decode_seconds_per_token` (a step of
decodes alone: the time per output token) plus the prefill tokens over
`prefill_tokens_per_second` (the scenario's prefill rate), so that a prefill alone runs at the
scenario's rate (plus a decode step's time per chunk) and a decode alone at its time per output
token: the same two constants the independent model uses, no new ones. Decode tokens' own cost
in a mixed step is in the first term.

Steps are taken in the fluid limit: between two changes (a job added or done) every step is the
same, so each job progresses at its share of a step per step time, and the next event is the
first job done; the last step of a job is counted by the tokens it takes, not rounded up to a
whole step. Exact in the number of steps a change waits for, to within one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# vLLM's default token budget per step with chunked prefill (max_num_batched_tokens).
DEFAULT_STEP_TOKENS = 8192


@dataclass(slots=True, eq=False)
class Job:
    """Work of one request: `prefill` tokens (its recompute, or its new tokens) or `decode`
    tokens (one a step); `done` is called when none remain."""

    kind: str  # "prefill" or "decode"
    remaining: float
    done: Callable[[], None]
    rate: float = 0.0  # tokens per second, until the next change


class SharedCompute:
    """One instance's GPU. `schedule(at, version)` asks its owner to call `advance(at, version)`
    then (a stale version is ignored: something changed since)."""

    def __init__(
        self,
        *,
        step_tokens: int,
        prefill_tokens_per_second: float,
        decode_seconds_per_token: float,
        schedule: Callable[[float, int], None],
    ) -> None:
        self.step_tokens = step_tokens
        self.prefill_rate = prefill_tokens_per_second
        self.decode_seconds = decode_seconds_per_token
        self._schedule = schedule
        self.prefills: list[Job] = []  # first come first served
        self.decodes: list[Job] = []
        self.version = 0
        self._since = 0.0
        # Seconds of steps that carried prefill, and of steps in all (GPU time shares).
        self.prefill_seconds = 0.0
        self.busy_seconds = 0.0
        self._prefill_share = 0.0  # of the current step time

    def add(self, kind: str, tokens: float, done: Callable[[], None], now: float) -> None:
        """Start a job now; one of no tokens is done at once."""
        if tokens <= 0:
            done()
            return
        self._settle(now)
        (self.prefills if kind == "prefill" else self.decodes).append(Job(kind, tokens, done))
        self._plan(now)

    def advance(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self._settle(now)
        finished = [j for j in (*self.prefills, *self.decodes) if j.remaining <= 1e-9]
        self.prefills = [j for j in self.prefills if j.remaining > 1e-9]
        self.decodes = [j for j in self.decodes if j.remaining > 1e-9]
        self._plan(now)
        for j in finished:  # may add jobs (a prefill's decode), which plans again
            j.done()

    def _settle(self, now: float) -> None:
        elapsed = now - self._since
        if elapsed > 0:
            for j in (*self.prefills, *self.decodes):
                j.remaining -= j.rate * elapsed
            if self.prefills or self.decodes:
                self.busy_seconds += elapsed
                self.prefill_seconds += elapsed * self._prefill_share
        self._since = now

    def _plan(self, now: float) -> None:
        """The step every job takes from now until the next change, and when that is."""
        self.version += 1
        budget: float = max(self.step_tokens - len(self.decodes), 0)
        shares = []
        for j in self.prefills:
            take = min(j.remaining, budget)
            shares.append(take)
            budget -= take
        prefill_tokens = sum(shares)
        step = self.decode_seconds + prefill_tokens / self.prefill_rate
        self._prefill_share = (prefill_tokens / self.prefill_rate) / step
        for j, take in zip(self.prefills, shares):
            j.rate = take / step
        for j in self.decodes:
            j.rate = 1.0 / step
        running = [j for j in (*self.prefills, *self.decodes) if j.rate > 0]
        if running:
            at = now + min(j.remaining / j.rate for j in running)
            self._schedule(at, self.version)
