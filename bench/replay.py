"""How fast and how big a full trace replay is: `kvprefetch bench replay`.

Each policy is measured in a fresh child process (`python -m bench.replay --worker ...`), one after
the other, so that one policy's heap and RSS high-water mark are not another's. The child:

1. notes its RSS after the imports (`baseline_rss_bytes`, psutil);
2. loads the trace once (`trace_load_seconds`);
3. replays it `rounds` times with sim.replay.replay, exactly what `kvprefetch replay` runs
   (sessions derived, cluster model, events applied to the engine's MemoryStore), timing each
   with perf_counter; `wall_seconds` is their median and `requests_per_second` the trace's
   requests over it. A policy whose first round already takes longer than the target gets only
   that one round (`wall_seconds_rounds` lists the rounds run);
4. reads its RSS high-water mark (`peak_rss_bytes`, getrusage: the interpreter, the imports and
   the loaded trace included);
5. replays once more under tracemalloc (about 2x slower, so untimed): `tracemalloc_peak_bytes` is
   the most Python heap that replay held at once, the loaded trace excluded.

The target (the issue): a full replay of mooncake_conversation_first60.jsonl with any policy
finishes within 60 s on the 2-core development machine; `within_target` compares each policy's
trace load plus median replay against it.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._util import REPO, child_env, info, machine, median

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/mooncake_conversation_first60.jsonl"
)
TARGET_SECONDS = 60.0


def all_policies() -> list[str]:
    """Every policy but the trained model's (`learned`: `--policy` times it
    alone) and `signal` (`none` in a replay without signals, as the bench's are)."""
    from sim.policies import POLICIES

    return [p for p in POLICIES if p not in ("learned", "signal")]


def measure(trace: Path, policy: str, router: str, scenario: str, rounds: int) -> dict[str, Any]:
    """One policy, in this process (meant to be a fresh one)."""
    import resource
    import tracemalloc

    import psutil

    from sim.commands import prepare
    from sim.replay import replay

    proc = psutil.Process()
    baseline_rss = int(proc.memory_info().rss)
    started = time.perf_counter()
    requests, scen = prepare(trace, scenario, None)
    load_seconds = time.perf_counter() - started
    walls = []
    summary: dict[str, Any] = {}
    for _ in range(rounds):
        gc.collect()
        started = time.perf_counter()
        summary = replay(requests, scen, policy=policy, router=router).summary
        walls.append(time.perf_counter() - started)
        if walls[0] > TARGET_SECONDS:
            break  # already past the target: more rounds would cost minutes and change no verdict
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak_rss = peak_kib if sys.platform == "darwin" else peak_kib * 1024
    gc.collect()
    tracemalloc.start()
    replay(requests, scen, policy=policy, router=router)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    wall = median(walls)
    return {
        "requests": len(requests),
        "simulated_seconds": summary["simulated_seconds"],
        "byte_hit_rate": summary["byte_hit_rate"],
        "trace_load_seconds": round(load_seconds, 3),
        "wall_seconds": round(wall, 3),
        "wall_seconds_rounds": [round(w, 3) for w in walls],
        "requests_per_second": round(len(requests) / wall, 1),
        "peak_rss_bytes": int(peak_rss),
        "baseline_rss_bytes": baseline_rss,
        "tracemalloc_peak_bytes": int(traced_peak),
    }


def _child(trace: Path, policy: str, router: str, scenario: str, rounds: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.replay",
        "--worker",
        "--trace",
        str(trace),
        "--policy",
        policy,
        "--router",
        router,
        "--scenario",
        scenario,
        "--rounds",
        str(rounds),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=child_env({}), capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[2:])} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}"
        )
    return json.loads(done.stdout)


def run(
    *,
    trace: Path | None = None,
    policy: str = "none",
    router: str = "sticky",
    scenario: str = "default",
    rounds: int = 3,
) -> dict[str, Any]:
    from app.core.errors import ConfigError
    from sim.policies import POLICIES, SCHEDULED_ALIAS
    from sim.policy_registry import make_policy
    from sim.routers import ROUTERS, make_router
    from sim.scenario import load_scenario

    path = (trace or DEFAULT_TRACE).resolve()
    if not path.is_file():
        raise ConfigError(
            f"no trace at {path}: pass --trace FILE (by default the bench replays the "
            "shared conversation trace, ../shared/traces/ next to the repository)"
        )
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    policies = all_policies() if policy == "all" else [policy]
    for p in policies:  # fail here, not in a child
        if p not in (*POLICIES, SCHEDULED_ALIAS):
            make_policy(p)  # raises, naming the policies there are
    if router not in ROUTERS:
        make_router(router)  # raises, naming the routers there are
    load_scenario(scenario)
    if Path(scenario).suffix:  # a TOML file: the children run in the repository
        scenario = str(Path(scenario).resolve())

    started = time.perf_counter()
    info(
        f"bench replay: {path.name}, {', '.join(policies)} / {router}, {rounds} round(s) each, "
        "one fresh process per policy"
    )
    results: dict[str, dict[str, Any]] = {}
    for p in policies:
        r = results[p] = _child(path, p, router, scenario, rounds)
        info(
            f"  {p:>10}: {r['wall_seconds']:6.2f} s median replay "
            f"(+{r['trace_load_seconds']:.2f} s load), "
            f"{r['requests_per_second']:,.0f} requests/s, "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB, "
            f"heap peak {r['tracemalloc_peak_bytes'] / 2**20:,.0f} MiB"
        )
    slowest = max(
        results, key=lambda p: results[p]["wall_seconds"] + results[p]["trace_load_seconds"]
    )
    worst = results[slowest]["wall_seconds"] + results[slowest]["trace_load_seconds"]
    return {
        "trace": path.name,
        "trace_path": str(path),
        "requests": results[slowest]["requests"],
        "router": router,
        "scenario": scenario,
        "rounds": rounds,
        "policies": results,
        "slowest_policy": slowest,
        "slowest_seconds_with_load": round(worst, 3),
        "target_seconds": TARGET_SECONDS,
        "within_target": worst <= TARGET_SECONDS,
        "bench_seconds": round(time.perf_counter() - started, 1),
        **machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="one policy of bench replay (see `kvprefetch bench replay`)"
    )
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--router", required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args()
    print(json.dumps(measure(args.trace, args.policy, args.router, args.scenario, args.rounds)))


if __name__ == "__main__":
    main()
