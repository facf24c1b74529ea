"""`kvprefetch replay --report`: the windowed hit rate and the stall ECDF on hand-built requests,
and the files the option writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.cluster import SimRequest
from sim.report import byte_hit_rate_series, ecdf, stall_ecdf
from tests.conftest import trace_slice

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sim(arrival: float, reused: int, hit: int, stall: float = 0.0) -> SimRequest:
    r = SimRequest(
        index=0,
        session_id="s",
        arrival=arrival,
        input_tokens=512,
        output_tokens=1,
        hash_ids=(1,),
        reused_blocks=reused,
        hit_blocks=hit,
    )
    r.admitted_at = arrival + 1.0
    r.ready_at = r.admitted_at + stall
    r.finished_at = r.ready_at + 2.0
    return r


def test_byte_hit_rate_is_summed_per_window_of_arrival() -> None:
    requests = [
        sim(0.0, 4, 4),
        sim(59.9, 6, 1),  # window 0: 5 of 10 blocks
        sim(60.0, 3, 0),  # window 1: 0 of 3
        sim(75.0, 0, 0),  # no reuse: not counted, and alone it would not make a window
        sim(200.0, 8, 6),
        sim(239.0, 0, 0),  # window 3: 6 of 8; window 2 has no reuse requests
    ]
    assert byte_hit_rate_series(requests, 60.0) == [(0.0, 0.5), (60.0, 0.0), (180.0, 0.75)]
    assert byte_hit_rate_series(requests, 100.0) == [(0.0, 5 / 13), (200.0, 0.75)]
    assert byte_hit_rate_series(requests, 60.0, measure_from_seconds=60.0) == [
        (60.0, 0.0),
        (180.0, 0.75),
    ]
    assert byte_hit_rate_series([], 60.0) == []
    with pytest.raises(ValueError):
        byte_hit_rate_series(requests, 0.0)


def test_ecdf_has_one_point_per_distinct_value() -> None:
    assert ecdf([3.0, 0.0, 1.0, 0.0]) == [(0.0, 0.5), (1.0, 0.75), (3.0, 1.0)]
    assert ecdf([2.0]) == [(2.0, 1.0)]
    assert ecdf([]) == []


def test_stall_ecdf_counts_reuse_requests_only() -> None:
    requests = [
        sim(0.0, 2, 2, stall=0.0),
        sim(1.0, 2, 0, stall=0.5),
        sim(2.0, 0, 0, stall=9.0),
        sim(3.0, 1, 0, stall=0.5),
        sim(4.0, 1, 1, stall=0.0),
    ]
    assert stall_ecdf(requests) == [(0.0, 0.5), (0.5, 1.0)]
    assert stall_ecdf(requests, measure_from_seconds=1.0) == [(0.0, 1 / 3), (0.5, 1.0)]
    unfinished = SimRequest(
        index=1,
        session_id="t",
        arrival=0.0,
        input_tokens=1,
        output_tokens=1,
        hash_ids=(2,),
        reused_blocks=1,
    )
    assert stall_ecdf([unfinished]) == [(0.0, 1.0)]


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    return trace_slice(tmp_path, "synthetic", 300)


@pytest.mark.parametrize("how", [["--compare", "none,lookahead,oracle"], ["--policy", "belady"]])
def test_report_writes_markdown_and_two_pngs(
    small_trace: Path, tmp_path: Path, how: list[str]
) -> None:
    out = tmp_path / "report"
    args = ["replay", "--trace", str(small_trace), *how, "--json", "--report", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # --json still prints exactly one object on stdout
    summaries = doc.get("compare", [doc])
    policies = [s["policy"] for s in summaries]
    assert policies == (["none", "lookahead", "oracle"] if "--compare" in how else ["belady"])

    for name in ("byte_hit_rate_over_time.png", "stall_distribution.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 10_000, name
    md = (out / "report.md").read_text()
    assert "| policy | router | hit rate | byte hit rate | byte hit rate unshared | stall s |" in md
    for p in policies:
        assert f"| {p} | sticky |" in md
    assert "synthetic300.jsonl" in md
    assert f"{summaries[0]['requests']:,} (" in md
    assert "- scenario: default" in md and "- router: sticky" in md
    assert f"`kvprefetch replay --trace {small_trace} {' '.join(how)} --json --report {out}`" in md
    assert "![byte hit rate over time](byte_hit_rate_over_time.png)" in md
