"""`kvprefetch events-from-trace --until/--fraction`: the time split done for the user."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.traces import judged_from_seconds, load_trace
from tests.conftest import trace_slice
from training.dataset import load_events


def write_log(trace: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        cli, ["events-from-trace", "--trace", str(trace), "--out", str(out), *extra]
    )
    return result.exit_code, result.output


def last_request_ts(log: Path) -> float:
    return max(e.ts for e in load_events(log) if type(e).__name__ == "RequestRouted")


def test_fraction_keeps_the_first_part_of_the_time_span_and_prints_the_cut(
    tmp_path: Path,
) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    cut = judged_from_seconds(load_trace(trace), 0.7)
    code, output = write_log(trace, tmp_path / "head.jsonl", "--fraction", "0.7")
    assert code == 0, output
    assert f"--measure-from {cut:.10g}" in output
    head = last_request_ts(tmp_path / "head.jsonl")
    kept = [r.arrival_seconds for r in load_trace(trace) if r.arrival_seconds < cut]
    assert head == pytest.approx(max(kept))
    code, output = write_log(trace, tmp_path / "all.jsonl")
    assert code == 0 and "measure-from" not in output
    assert last_request_ts(tmp_path / "all.jsonl") > cut


def test_until_cuts_at_a_trace_time(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    code, output = write_log(trace, tmp_path / "head.jsonl", "--until", "40")
    assert code == 0, output
    assert "before 40 s" in output
    assert last_request_ts(tmp_path / "head.jsonl") < 40


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--until", "10", "--fraction", "0.5"], "not both"),
        (["--fraction", "0"], "in (0, 1]"),
        (["--fraction", "1.5"], "in (0, 1]"),
        (["--until", "-1"], "no request of the trace arrives before"),
    ],
)
def test_a_bad_split_is_refused(tmp_path: Path, extra: list[str], message: str) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    code, output = write_log(trace, tmp_path / "x.jsonl", *extra)
    assert code == 2
    assert message in " ".join(output.split())
    assert not (tmp_path / "x.jsonl").exists()
