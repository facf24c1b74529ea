"""Progress reports: heard only when asked for, and never changing what is computed."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
from rich.console import Console

from training import build_dataset, train
from training.progress import rich_bars

ROUNDS = 30  # a short run is enough to see the reports


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []

    def __call__(self, task: str, done: int, total: int | None) -> None:
        self.calls.append((task, done, total))

    def of(self, task: str) -> list[tuple[int, int | None]]:
        return [(done, total) for t, done, total in self.calls if t == task]


def test_replay_reports_events_done_and_gives_the_same_rows(
    tiny_log: Path, tiny_rows: pd.DataFrame
) -> None:
    heard = Recorder()
    rows = build_dataset([tiny_log], heard)
    pd.testing.assert_frame_equal(rows, tiny_rows)
    reports = heard.of(f"replaying {tiny_log.name}")
    total = reports[-1][1]
    assert reports[0] == (0, None) and reports[-1] == (total, total) and total
    assert any(0 < done < total for done, _ in reports), "no report while the replay ran"
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)


def test_training_reports_rounds_and_gives_the_same_model(tiny_rows: pd.DataFrame) -> None:
    heard = Recorder()
    with_progress = train(tiny_rows, progress=heard, num_boost_round=ROUNDS)
    quiet = train(tiny_rows, num_boost_round=ROUNDS)
    assert with_progress.booster.model_to_string() == quiet.booster.model_to_string()
    rounds = heard.of("boosting rounds")
    ran = with_progress.booster.current_iteration()
    assert rounds[0] == (1, ROUNDS) and rounds[-1] == (ran, ran)


def test_rich_bars_draw_each_task_on_their_console(tiny_rows: pd.DataFrame) -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, force_interactive=True, width=100)
    with rich_bars(console) as progress:
        train(tiny_rows, progress=progress, num_boost_round=ROUNDS)
    assert "boosting rounds" in screen.getvalue()
