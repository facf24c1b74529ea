"""`kvprefetch bench mooncake`: one small round against a real master, in the documented shape."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli


@pytest.mark.slow
def test_bench_mooncake_prints_the_agent_beside_a_plain_get() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "mooncake",
            "--json",
            "--rounds",
            "1",
            "--blocks",
            "2",
            "--context-bytes",
            str(4 << 20),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert (doc["bench"], doc["context_bytes"], doc["blocks"], doc["rounds"]) == (
        "mooncake",
        4 << 20,
        2,
        1,
    )
    for figure in ("agent_ttlb_seconds", "agent_order_seconds", "plain_get_seconds"):
        assert 0 < doc[figure]["min"] <= doc[figure]["median"] <= doc[figure]["max"]
