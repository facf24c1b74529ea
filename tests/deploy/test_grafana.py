"""deploy/grafana: the dashboard JSON and its provisioning, checked against what GET /metrics
exposes.

Every metric a panel queries must be one the service exposes, with the labels it has (the names
come from scraping a real app's /metrics after a few events, not from a list kept here); every
counter (and histogram series) is read through rate()/increase(), never raw; the expressions
parse as PromQL (promtool check rules, Debian's prometheus package, installed by
.ci/ensure-promtool when missing).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.api.main import create_app
from app.core.config import Settings
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvprefetch.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
UID = "kvprefetch-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE_FUNCTIONS = {"rate", "increase", "irate"}
# Labels Prometheus attaches to every scraped series, beside the service's own.
TARGET_LABELS = {"instance", "job"}
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$__interval": "15s",
    "$instance": ".*",
}

PROMQL_KEYWORDS = {"and", "or", "unless", "offset", "bool", "atan2"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
}


# -- what the service exposes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Exposed:
    """Sample name -> (its family's type, the label names its samples carry)."""

    samples: dict[str, tuple[str, frozenset[str]]]

    def is_counter_like(self, name: str) -> bool:
        """Counters and histogram series only ever grow: read them with rate()/increase()."""
        return self.samples[name][0] in ("counter", "histogram", "summary")


def _turn(n: int, ts: float, blocks: list[int]) -> list[dict[str, Any]]:
    """One turn of session s1 on gpu-0: routed, started, finished, its blocks stored in HBM."""
    ids = {"session_id": "s1", "request_id": f"q{n}", "instance_id": "gpu-0"}
    return [
        {
            "type": "request_routed",
            "event_id": f"r{n}",
            "ts": ts,
            **ids,
            "prompt_tokens": 512 * len(blocks),
            "block_hashes": blocks,
        },
        {"type": "request_started", "event_id": f"st{n}", "ts": ts + 0.1, **ids},
        {
            "type": "request_finished",
            "event_id": f"f{n}",
            "ts": ts + 1.0,
            **ids,
            "output_tokens": 20,
            "context_tokens": 512 * len(blocks) + 20,
        },
        {
            "type": "kv_blocks_stored",
            "event_id": f"kv{n}",
            "ts": ts + 1.0,
            "tier": "hbm",
            "instance_id": "gpu-0",
            "block_hashes": blocks,
        },
        {
            "type": "instance_status",
            "event_id": f"is{n}",
            "ts": ts + 1.0,
            "instance_id": "gpu-0",
            "free_kv_bytes": 10**11,
            "total_kv_bytes": 3 * 10**11,
        },
    ]


def _scrape_until(client: TestClient, wanted: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        response = client.get("/metrics")
        assert response.status_code == 200, response.text
        if wanted in response.text or time.monotonic() > deadline:
            return response.text
        time.sleep(0.05)


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Exposed:
    """GET /metrics of a real app (its scoring and planning loops on) after a session's two turns
    (the second reusing the first's blocks, resident: a hit), a duplicate and a rejected event."""
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("svc"),
        store="memory",
        log_fsync=False,
        replica_id="test-grafana",
        score_interval_seconds=0.05,
        plan_interval_seconds=0.05,
    )
    now = time.time()
    with TestClient(create_app(settings)) as client:
        first = _turn(1, now - 20.0, [11, 12, 13])
        assert client.post("/v1/events", json={"events": first}).status_code == 200
        _scrape_until(
            client, "kvprefetch_inference_duration_seconds_bucket"
        )  # the session was scored
        assert (
            client.post("/v1/events", json={"events": _turn(2, now, [11, 12, 13, 14])}).status_code
            == 200
        )
        assert client.post("/v1/events", json={"events": first[:1]}).json()["duplicates"] == ["r1"]
        bad = client.post(
            "/v1/events", json={"events": [{**first[0], "event_id": "bad", "prompt_tokens": -1}]}
        )
        assert bad.status_code == 422
        text = _scrape_until(client, "kvprefetch_inference_duration_seconds_bucket")
    samples: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            _, labels = samples.setdefault(sample.name, (family.type, set()))
            labels.update(sample.labels)
    assert any(name.startswith("kvprefetch_") for name in samples), (
        "no kvprefetch_ metric in /metrics"
    )
    return Exposed({name: (kind, frozenset(labels)) for name, (kind, labels) in samples.items()})


# -- the dashboard --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def targets_of(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in panels_of(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target


def variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    found = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    assert len(found) == 1, f"no template variable {name!r}"
    return found[0]


def test_the_dashboard_has_a_fixed_uid_and_a_title(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == UID
    assert dashboard["title"] == "kvprefetch"
    assert dashboard.get("id") is None  # an exported id would clash on import


def test_the_datasource_is_a_variable(dashboard: dict[str, Any]) -> None:
    ds = variable(dashboard, "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # Every panel and query reads the variable: no datasource uid of some other Grafana is baked in.
    for panel in panels_of(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE, panel["title"]
    for title, target in targets_of(dashboard):
        assert target["datasource"] == DATASOURCE, title
    assert variable(dashboard, "instance")["datasource"] == DATASOURCE
    assert (
        "${DS_" not in DASHBOARD.read_text()
    )  # no import-time input left unresolved by provisioning


def test_panels_are_laid_out_and_each_queries(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels_of(dashboard)]
    assert len(ids) == len(set(ids))
    refs: set[str] = set()
    for panel in panels_of(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel.get("description"), (
            f"panel {panel['title']!r} says nothing about what it shows"
        )
        refs = {t["refId"] for t in panel["targets"]}
        assert len(refs) == len(panel["targets"]), panel["title"]


def test_the_panels_the_issue_asks_for_are_there(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(t["expr"] for _, t in targets_of(dashboard))
    for needle in (
        "rate(kvprefetch_reuse_requests_total",
        "kvprefetch_events_ingested_total",
        "sum by (kind) (rate(kvprefetch_orders_issued_total",
        "kvprefetch_prefetch_ordered_bytes_total",
        "kvprefetch_prefetch_wasted_bytes_total",
        "kvprefetch_stall_avoided_seconds_total",
        "kvprefetch_gpu_saved_dollars_total",
        "kvprefetch_plan_duration_seconds_bucket",
        "kvprefetch_inference_duration_seconds_bucket",
        "sum by (slot) (rate(kvprefetch_advice_outcomes_total",
    ):
        assert needle in exprs, needle
    assert exprs.count("histogram_quantile(") >= 4


# -- the queries against the exposition -----------------------------------------------------------


@dataclass
class MetricRef:
    name: str
    labels: set[str] = field(default_factory=set)  # label names in its matchers
    inside: str = ""  # the innermost function (or aggregation) it is an argument of


@dataclass
class Parsed:
    metrics: list[MetricRef]
    grouping: set[str]  # label names in by/without/on/ignoring lists


IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
LABEL_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*")


def _skip_string(expr: str, i: int) -> int:
    quote = expr[i]
    i += 1
    while expr[i] != quote:
        i += 2 if expr[i] == "\\" else 1
    return i + 1


def _next_char(expr: str, i: int) -> str:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return expr[i] if i < len(expr) else ""


def parse(expr: str) -> Parsed:
    """The metric names a PromQL expression reads, each with its matchers' label names and the
    function it sits in; and the grouping labels. Enough PromQL for dashboards, not all of it."""
    metrics: list[MetricRef] = []
    grouping: set[str] = set()
    stack: list[str] = []  # the function or aggregation each open parenthesis belongs to
    pending = ""  # a function or aggregation name waiting for its parenthesis
    last: MetricRef | None = None
    i = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "[":  # a range or subquery's duration
            i = expr.index("]", i) + 1
        elif c == "{":
            end = i + 1
            labels: set[str] = set()
            while expr[end] != "}":
                m = LABEL_NAME.match(expr, end)
                assert m, f"cannot read the matchers of {expr!r} at {end}"
                labels.add(m.group(1))
                end = _skip_string(expr, m.end())
                while expr[end] in " ,":
                    end += 1
            if last is None:  # {__name__=...} alone: not used here
                raise AssertionError(f"a selector without a metric name in {expr!r}")
            last.labels |= labels
            i = end + 1
        elif c == "(":
            stack.append(pending)
            pending = ""
            i += 1
        elif c == ")":
            stack.pop()
            i += 1
        elif IDENT.match(expr, i):
            word = IDENT.match(expr, i).group(0)  # type: ignore[union-attr]
            i += len(word)
            if word in GROUPING:
                close = expr.index(")", i)
                grouping.update(
                    w.strip() for w in expr[expr.index("(", i) + 1 : close].split(",") if w.strip()
                )
                i = close + 1
            elif word in AGGREGATIONS or _next_char(expr, i) == "(":
                pending = word
            elif word in PROMQL_KEYWORDS:
                pass
            else:
                last = MetricRef(word, inside=stack[-1] if stack else "")
                metrics.append(last)
        elif c.isdigit() or c == ".":  # a number (0.99, 3600, 1e9)
            while i < len(expr) and (
                expr[i].isalnum() or expr[i] == "." or (expr[i] in "+-" and expr[i - 1] in "eE")
            ):
                i += 1
        else:  # an operator, a comma or a space
            if not c.isspace():
                last = None
            i += 1
    return Parsed(metrics, grouping)


def test_the_promql_reader_reads_what_the_dashboard_writes() -> None:
    p = parse(
        "histogram_quantile(0.99, sum by (le, slot) "
        '(rate(a_bucket{instance=~"x|y",slot="live"}[1m])))'
    )
    assert [(m.name, m.labels, m.inside) for m in p.metrics] == [
        ("a_bucket", {"instance", "slot"}, "rate")
    ]
    assert p.grouping == {"le", "slot"}
    p = parse('sum(rate(b_total{k="v}"}[5m])) * 3600 / sum(c_total) + max by (v) (g) == 1')
    assert [(m.name, m.inside) for m in p.metrics] == [
        ("b_total", "rate"),
        ("c_total", "sum"),
        ("g", "max"),
    ]


def substituted(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def test_every_query_reads_only_metrics_the_service_exposes(
    dashboard: dict[str, Any], exposed: Exposed
) -> None:
    seen: set[str] = set()
    for title, target in targets_of(dashboard):
        parsed = parse(substituted(target["expr"]))
        assert parsed.metrics, f"{title}: {target['expr']!r} reads no metric"
        known = set(TARGET_LABELS)
        for ref in parsed.metrics:
            assert ref.name in exposed.samples, (
                f"panel {title!r} reads {ref.name}, which GET /metrics does not expose"
            )
            labels = exposed.samples[ref.name][1]
            assert ref.labels <= labels | TARGET_LABELS, (
                f"panel {title!r}: {ref.name} has no label(s) "
                f"{sorted(ref.labels - labels - TARGET_LABELS)}"
            )
            known |= labels
            seen.add(ref.name)
        assert parsed.grouping <= known, (
            f"panel {title!r} groups by unknown labels {parsed.grouping - known}"
        )
    # The instance variable lists a metric that is there.
    query = variable(dashboard, "instance")["query"]["query"]
    m = re.fullmatch(r"label_values\((\w+), instance\)", query)
    assert m and m.group(1) in exposed.samples
    # Every kvprefetch counter is on some panel: a new one fails this until it is charted.
    families = {
        n
        for n, (kind, _) in exposed.samples.items()
        if n.startswith("kvprefetch_") and kind == "counter"
    }
    assert not families - seen, f"counters on no panel: {sorted(families - seen)}"


def test_counters_are_read_through_rate_or_increase(
    dashboard: dict[str, Any], exposed: Exposed
) -> None:
    for title, target in targets_of(dashboard):
        for ref in parse(substituted(target["expr"])).metrics:
            if exposed.is_counter_like(ref.name):
                assert ref.inside in RATE_FUNCTIONS, (
                    f"panel {title!r} reads the counter {ref.name} "
                    f"inside {ref.inside or 'nothing'}(), "
                    "not rate() or increase()"
                )
            else:
                assert ref.inside not in RATE_FUNCTIONS, (
                    f"panel {title!r} takes the rate of gauge {ref.name}"
                )


# -- PromQL and Prometheus's own checks -----------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus's promtool (Debian's prometheus package); installed when missing, else a
    failure."""
    if shutil.which("promtool") is None and (REPO / ".ci" / "ensure-promtool").exists():
        subprocess.run(["bash", str(REPO / ".ci" / "ensure-promtool")], check=False, timeout=600)
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is required "
            "(Debian: apt-get install prometheus; .ci/ensure-promtool does it)",
            pytrace=False,
        )
    return path


def test_every_query_parses_as_promql(
    dashboard: dict[str, Any], promtool: str, tmp_path: Path
) -> None:
    rules = [
        {"record": f"kvprefetch:dashboard_query_{i}", "expr": substituted(t["expr"])}
        for i, (_, t) in enumerate(targets_of(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout + done.stderr


def test_the_prometheus_config_is_valid(promtool: str) -> None:
    path = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert jobs["kvprefetch"].get("metrics_path", "/metrics") == "/metrics"


# -- provisioning ---------------------------------------------------------------------------------


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    (ds_file,) = (PROVISIONING / "datasources").glob("*.yml")
    (source,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"].startswith("http://")
    (dash_file,) = (PROVISIONING / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(dash_file.read_text())["providers"]
    assert provider["type"] == "file"
    # tests/deploy/test_compose.py checks compose mounts deploy/grafana/dashboards at this path.
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    assert [p.name for p in DASHBOARD.parent.glob("*.json")] == [DASHBOARD.name]
