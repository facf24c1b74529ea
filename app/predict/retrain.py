"""Retraining on a schedule: a candidate from the service's own event log, judged in shadow.

Every KVP_RETRAIN_EVERY_SECONDS (by the engine's clock, so a replay's simulated time counts), when
at least KVP_RETRAIN_MIN_ARRIVALS requests were routed since the last run:

1. train a candidate in a child process (`python -m training.retrain_job`, RETRAIN_JOB_MODULE: the
   CPU work stays off the event loop, and the service package never imports training) on the
   newest segments of the event log, split by time; it is written to
   <models root>/retrained/<version>;
2. load it as the shadow (checked on live sessions, as PUT /v1/model/shadow does);
3. while it shadows, the advice ledger's judge pairs its p_keep with the serving model's on the
   same sessions and ticks (app/observe/judge.py); promote it (it serves, as POST
   /v1/model/promote does) when its Brier score is better by KVP_RETRAIN_PROMOTE_MARGIN and two
   paired standard errors on at least KVP_RETRAIN_MIN_JUDGED outcomes; discard it when it is
   worse by two standard errors, or still undecided after KVP_RETRAIN_SHADOW_SECONDS.

A run is skipped while an operator's shadow is set (the candidate would replace it) and when the
engine keeps no event log (a replay). Every run ends in one outcome: promoted, discarded, failed
(training or loading failed; the serving model is untouched), skipped.

The child needs the 'training' extra (pandas, scikit-learn): with retraining on and the extra
missing, the service does not start (a ConfigError naming it) rather than fail every run later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from app.core.clock import Clock
from app.core.config import Settings
from app.core.errors import ConfigError, MissingExtraError
from app.core.extras import require_extra
from app.observe.judge import JudgeStats, verdict
from app.observe.ledger import AdviceLedger
from app.predict.predictors import ModelError
from app.predict.slots import ModelSlots
from app.state.base import SessionView
from kvprefetch_client.events import Event

if TYPE_CHECKING:
    from app.observe.metrics import Metrics
    from app.predict.lifecycle import ModelLifecycle

log = logging.getLogger(__name__)

Outcome = Literal["promoted", "discarded", "failed", "skipped"]
OUTCOMES: tuple[Outcome, ...] = ("promoted", "discarded", "failed", "skipped")
# The retraining child's entry point, run as `python -m RETRAIN_JOB_MODULE` with this interpreter:
# training/retrain_job.py, whose main() parses the arguments _command() gives. Named here as text,
# not imported, because the service package never imports training (tests/test_layout.py); its
# tests check that it names a module with that main (tests/training/test_retrain_job.py).
RETRAIN_JOB_MODULE = "training.retrain_job"
# How often the loop looks at the clock and the judge; a run is due every retrain_every_seconds.
CHECK_SECONDS = 5.0
# Where candidates are written, under the models root.
RETRAINED_DIR = "retrained"
# Of a failed run's stderr, the last this many characters are kept for GET /v1/model/retrain.
STDERR_CHARS = 500


@dataclass(frozen=True, slots=True)
class RunResult:
    outcome: Outcome
    reason: str
    ts: float  # by the engine's clock
    version: str | None
    judged: int
    live_brier: float | None
    shadow_brier: float | None


@dataclass(slots=True)
class _Candidate:
    version: str
    directory: Path
    shadow_since_ts: float


class Retrainer:
    """`sample`: live sessions a candidate must answer for before it shadows or serves;
    `metrics`, when given, is told each run's outcome and the judge's scores."""

    def __init__(
        self,
        settings: Settings,
        models: ModelSlots,
        ledger: AdviceLedger,
        clock: Clock,
        *,
        lifecycle: ModelLifecycle,
        log_dir: Path | None,
        sample: Callable[[], Awaitable[Sequence[SessionView]]],
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.models = models
        self.ledger = ledger
        self.clock = clock
        self.lifecycle = lifecycle
        self.log_dir = log_dir
        self.sample = sample
        self.metrics = metrics
        self.every_seconds = settings.retrain_every_seconds
        self.enabled = self.every_seconds > 0
        if self.enabled:
            try:
                require_extra("training", "KVP_RETRAIN_EVERY_SECONDS > 0 (retraining)")
            except MissingExtraError as exc:
                raise ConfigError(str(exc)) from None
        self.state: Literal["off", "waiting", "training", "shadowing"] = (
            "waiting" if self.enabled else "off"
        )
        self.next_run_ts: float | None = None
        self.arrivals = 0  # requests routed since the last run began
        self.runs: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)
        self.last: RunResult | None = None
        self.candidate: _Candidate | None = None
        self._seq = 0

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: counts the requests routed, the new traffic a run learns from."""
        for e in events:
            if e.type == "request_routed":
                self.arrivals += 1

    # -- the schedule --------------------------------------------------------------------------

    async def run(self, check_seconds: float = CHECK_SECONDS) -> None:
        """Step every `check_seconds` until cancelled (a training child is killed then)."""
        while True:
            await asyncio.sleep(min(check_seconds, self.every_seconds))
            try:
                await self.step()
            except Exception:  # one bad run never ends the schedule
                log.exception("retraining step failed")

    async def step(self, *, force: bool = False) -> Outcome | None:
        """What is due now by the clock: judge the shadowing candidate, or start a run (`force`:
        now, whatever the schedule). Returns the outcome of a run that ended, else None."""
        now = self.clock.now()
        if self.candidate is not None:
            return await self._judge(now)
        if self.next_run_ts is None:
            # The first run one period after start: a fresh service has learnt nothing new yet.
            self.next_run_ts = now + self.every_seconds
        if not force and (not self.enabled or now < self.next_run_ts):
            return None
        self.next_run_ts = now + self.every_seconds
        return await self._start(now)

    async def _start(self, now: float) -> Outcome | None:
        s = self.settings
        if self.log_dir is None:
            return self._finish("skipped", "this engine keeps no event log", now)
        if self.models.shadow is not None:
            return self._finish(
                "skipped", "a shadow model is set; a candidate would replace it", now
            )
        if self.arrivals < s.retrain_min_arrivals:
            return self._finish(
                "skipped",
                f"{self.arrivals} requests routed since the last run, fewer than "
                f"KVP_RETRAIN_MIN_ARRIVALS ({s.retrain_min_arrivals})",
                now,
            )
        self.arrivals = 0
        version = self._version(now)
        root = self.models.models_root / RETRAINED_DIR
        directory = root / version
        partial = root / f".{version}.partial"
        self.state = "training"
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            problem = await self._train(partial, version)
            if problem is None:
                partial.rename(directory)  # the version appears whole or not at all
        except OSError as exc:
            problem = f"cannot write the candidate: {exc}"
        except asyncio.CancelledError:  # the engine is closing: the child is killed, no leftovers
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            self.state = "waiting"
        if problem is not None:
            shutil.rmtree(partial, ignore_errors=True)
            return self._finish("failed", problem, now, version)
        try:
            sample = await self.sample()
            await self.lifecycle.set_shadow(directory, sample, self.clock.now())
        except ModelError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            return self._finish("failed", f"the candidate does not load: {exc}", now, version)
        self.candidate = _Candidate(version, directory, self.clock.now())
        self.state = "shadowing"
        log.info("retrained model %s shadows the serving one", version)
        return None

    def _version(self, now: float) -> str:
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max(now, 0.0)))
        return f"retrain-{stamp}-{self._seq}"

    def _command(self, out: Path, version: str) -> list[str]:
        s = self.settings
        assert self.log_dir is not None
        return [
            sys.executable,
            "-m",
            RETRAIN_JOB_MODULE,
            "--log-dir",
            str(self.log_dir),
            "--out",
            str(out),
            "--name",
            version,
            "--max-log-bytes",
            str(s.retrain_max_log_bytes),
            "--valid-fraction",
            str(s.retrain_valid_fraction),
            "--max-rounds",
            str(s.retrain_max_rounds),
        ]

    async def _train(self, out: Path, version: str) -> str | None:
        """Run the training child; None when it wrote the candidate, else why not."""
        proc = await asyncio.create_subprocess_exec(
            *self._command(out, version),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, stderr = await asyncio.wait_for(
                proc.communicate(), self.settings.retrain_timeout_seconds
            )
        except TimeoutError:
            return (
                f"training ran past KVP_RETRAIN_TIMEOUT_SECONDS "
                f"({self.settings.retrain_timeout_seconds:g})"
            )
        finally:
            if proc.returncode is None:  # timed out, or the engine is closing
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip()[-STDERR_CHARS:]
            return f"training exited with {proc.returncode}: {tail}"
        return None

    # -- the shadow's verdict ------------------------------------------------------------------

    async def _judge(self, now: float) -> Outcome | None:
        candidate = self.candidate
        assert candidate is not None
        shadow = self.models.shadow
        stats = self.ledger.judge.stats()
        if self.metrics is not None:
            self.metrics.retrain_judged(stats)
        if shadow is None or shadow.version != candidate.version:
            self.candidate = None
            shutil.rmtree(candidate.directory, ignore_errors=True)  # nothing serves from it
            return self._finish(
                "discarded", "an operator replaced or removed the shadow", now, candidate.version
            )
        s = self.settings
        decision = verdict(stats, min_judged=s.retrain_min_judged, margin=s.retrain_promote_margin)
        if decision == "wait":
            if now - candidate.shadow_since_ts < s.retrain_shadow_seconds:
                return None
            decision = "discard"
            reason = (
                f"undecided after KVP_RETRAIN_SHADOW_SECONDS ({s.retrain_shadow_seconds:g}): "
                f"{_scores(stats)}"
            )
        else:
            reason = _scores(stats)
        self.candidate = None
        if decision == "discard":
            await self.lifecycle.clear_shadow()
            shutil.rmtree(candidate.directory, ignore_errors=True)
            return self._finish("discarded", reason, now, candidate.version, stats)
        # It has scored the live sessions all along: it moves to serving as it is, with its counts
        # (a promote clears the shadow slot).
        await self.lifecycle.promote()
        return self._finish("promoted", reason, now, candidate.version, stats)

    def _finish(
        self,
        outcome: Outcome,
        reason: str,
        now: float,
        version: str | None = None,
        stats: JudgeStats | None = None,
    ) -> Outcome:
        self.state = "waiting" if self.enabled else "off"
        self.runs[outcome] += 1
        self.last = RunResult(
            outcome,
            reason,
            now,
            version,
            stats.judged if stats else 0,
            stats.live_brier if stats else None,
            stats.shadow_brier if stats else None,
        )
        (log.warning if outcome == "failed" else log.info)(
            "retraining run %s: %s (%s)", outcome, reason, version or "no candidate"
        )
        if self.metrics is not None:
            self.metrics.retrain_finished(outcome, now)
        return outcome

    def status(self) -> dict[str, Any]:
        """What GET /v1/model/retrain and the dashboard show."""
        stats = self.ledger.judge.stats() if self.candidate is not None else None
        return {
            "enabled": self.enabled,
            "state": self.state,
            "every_seconds": self.every_seconds,
            "next_run_ts": self.next_run_ts if self.enabled else None,
            "arrivals_since_last_run": self.arrivals,
            "min_arrivals": self.settings.retrain_min_arrivals,
            "runs": dict(self.runs),
            "candidate": (
                {
                    "version": self.candidate.version,
                    "shadow_since_ts": self.candidate.shadow_since_ts,
                    "judge": asdict(stats) if stats is not None else None,
                    "min_judged": self.settings.retrain_min_judged,
                }
                if self.candidate is not None
                else None
            ),
            "last": asdict(self.last) if self.last is not None else None,
        }


def _scores(stats: JudgeStats) -> str:
    if stats.live_brier is None or stats.shadow_brier is None:
        return "no outcome judged"
    se = f" ± {stats.gain_se:.5f}" if stats.gain_se is not None else ""
    return (
        f"Brier {stats.shadow_brier:.5f} (candidate) against {stats.live_brier:.5f} (serving) "
        f"on {stats.judged} paired outcomes; gain {stats.mean_gain:.5f}{se}"
    )


__all__ = ["CHECK_SECONDS", "OUTCOMES", "RETRAINED_DIR", "Retrainer", "RunResult"]
