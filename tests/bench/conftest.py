"""Running a benchmark command as a real process and reading its one JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_bench(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`kvprefetch bench ARGS --json`: exit 0 and exactly one JSON object on stdout. `env`: set
    in the command's environment."""
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "bench", *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env} if env else None,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON object, got:\n{done.stdout}"
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    return result


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
