"""The replay's results table is never cut short: Markdown when stdout is not a terminal, cells
folded (not ellipsized) in a narrow one (issue 30)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.commands import COLUMNS, render_table
from tests.conftest import trace_slice


def test_a_piped_table_is_markdown_with_every_column_whole(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "synthetic", 100)
    result = CliRunner().invoke(
        cli, ["replay", "--trace", str(trace), "--compare", "none,lookahead"]
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "…" not in out
    assert "| " + " | ".join(header for _, header, _ in COLUMNS) + " |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| none |", "| lookahead |"))]
    assert len(rows) == 2
    assert all(row.count("|") == len(COLUMNS) + 1 for row in rows)


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them() -> None:
    summary = {key: 0.5 for key, _, _ in COLUMNS}
    summary.update(policy="lookahead", router="least-loaded", recompute_tokens=123456789)
    out = io.StringIO()
    Console(file=out, width=60, force_terminal=True, color_system=None).print(
        render_table([summary], "t")
    )
    assert "…" not in out.getvalue()
