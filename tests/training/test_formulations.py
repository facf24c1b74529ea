"""`python -m training.formulations`: every formulation judged at every horizon, the same each
run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.formulations import EVAL_HORIZONS, FORMULATIONS, main, render


def test_prints_every_formulation_at_every_horizon_deterministically(
    tiny_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--events", str(tiny_log), "--json"])
    out = json.loads(capsys.readouterr().out)
    horizons = {str(int(h)) for h in EVAL_HORIZONS}
    for name in FORMULATIONS:
        assert set(out["results"][name]) == horizons
    judged_30 = out["judged"]["30"]["rows"]
    assert judged_30 > 0 and all(
        0 <= out["results"][name]["30"]["brier"] <= 1 for name in FORMULATIONS
    )
    main(["--events", str(tiny_log)])
    table = capsys.readouterr().out
    # A second run prints what the first computed: training is seeded and deterministic.
    assert table == render(out) + "\n"
    rows = [line.split()[0] for line in table.splitlines() if line.split()[1:2] == ["30"]]
    assert set(FORMULATIONS) <= set(rows)
