"""docker-compose.yml: valid for the real Compose v2 (`docker compose config`, no engine needed),
and wired together: the service on Redis, Prometheus scraping the service, Grafana reading
Prometheus and the dashboard.

.ci/compose-config runs the check; on a machine without `docker compose` it fetches Debian's
docker-compose (v2) into .venv/tools first. A Compose that cannot be had fails these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.conftest import REPO

SCRIPT = REPO / ".ci" / "compose-config"
SERVICES = {"kvprefetch", "redis", "prometheus", "grafana"}


def compose_config(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """docker-compose.yml as Compose v2 reads it (defaults interpolated, paths absolute)."""
    done = compose_config("--format", "json")
    assert done.returncode == 0, f"docker compose config failed:\n{done.stderr}"
    assert "Docker Compose version" in done.stderr  # the real one said its name
    return json.loads(done.stdout)


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (the bind's host path, or the volume's name; read-only)."""
    return {
        v["target"]: (v["source"], bool(v.get("read_only"))) for v in service.get("volumes", [])
    }


def test_compose_config_accepts_the_file(config: dict[str, Any]) -> None:
    assert set(config["services"]) == SERVICES


def test_compose_config_refuses_a_broken_file(config: dict[str, Any], tmp_path: Path) -> None:
    """The check is a real one: a key Compose does not know, or a missing dependency, fails it."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(
        "services:\n  a:\n    image: redis:7.2.5\n    depends_on: [b]\n    restart_policy: x\n"
    )
    done = compose_config("--quiet", env={"KVP_COMPOSE_FILE": str(bad)})
    assert done.returncode != 0
    assert "restart_policy" in done.stderr or "depends on undefined service" in done.stderr


def test_a_compose_that_cannot_be_had_is_a_failure_not_a_skip(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text("#!/bin/sh\nexit 1\n")  # a docker CLI with no compose plugin
    fake.chmod(0o755)
    done = compose_config(
        "--quiet",
        env={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "KVP_TOOLS_DIR": str(tmp_path / "tools"),
            "KVP_DEBIAN_MIRROR": "http://127.0.0.1:9/debian",
        },
    )  # nothing listens there
    assert done.returncode == 1
    assert "compose-config: FAILED:" in done.stderr


def test_images_are_official_and_pinned(config: dict[str, Any]) -> None:
    images = {name: s.get("image", "") for name, s in config["services"].items()}
    assert "build" in config["services"]["kvprefetch"]
    for name, expected in (
        ("redis", "redis:"),
        ("prometheus", "prom/prometheus:"),
        ("grafana", "grafana/grafana:"),
    ):
        image = images[name]
        assert image.startswith(expected), image
        tag = image.split(":", 1)[1]
        assert tag != "latest" and any(c.isdigit() for c in tag) and tag.count(".") >= 2, (
            f"{image}: pin a version"
        )


def test_every_service_has_a_healthcheck(config: dict[str, Any]) -> None:
    for name, service in config["services"].items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_the_service_keeps_its_state_in_the_compose_redis(config: dict[str, Any]) -> None:
    service = config["services"]["kvprefetch"]
    env = service["environment"]
    assert env["KVP_STORE"] == "redis"
    assert urlsplit(env["KVP_REDIS_URL"]).hostname == "redis"
    assert urlsplit(env["KVP_REDIS_URL"]).port in (None, 6379)
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert float(env["KVP_GPU_HOUR_PRICE"]) > 0
    published = {p["target"]: int(p["published"]) for p in service["ports"]}
    assert published == {int(env["KVP_PORT"]): 8000}


def test_the_public_service_reads_its_tokens_from_a_secret(config: dict[str, Any]) -> None:
    # It listens on 0.0.0.0, which the service refuses without tokens (app/core/security.py).
    service = config["services"]["kvprefetch"]
    assert service["environment"]["KVP_HOST"] == "0.0.0.0"
    (secret,) = service["secrets"]
    assert service["environment"]["KVP_TOKENS_FILE"] == f"/run/secrets/{secret['source']}"
    assert Path(config["secrets"][secret["source"]]["file"]) == REPO / "deploy" / "tokens.toml"
    assert "deploy/tokens.toml" in (REPO / ".gitignore").read_text().splitlines()


def test_prometheus_scrapes_the_service(config: dict[str, Any]) -> None:
    prometheus = config["services"]["prometheus"]
    source, read_only = mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    assert Path(source) == REPO / "deploy" / "prometheus" / "prometheus.yml" and read_only
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    scrape = yaml.safe_load(Path(source).read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "kvprefetch"]
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    port = config["services"]["kvprefetch"]["environment"]["KVP_PORT"]
    assert targets == [
        f"kvprefetch:{port}"
    ]  # the compose service's name and the port it listens on
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_reads_prometheus_and_the_dashboard(config: dict[str, Any]) -> None:
    grafana = config["services"]["grafana"]
    m = mounts(grafana)
    provisioning, ro = m["/etc/grafana/provisioning"]
    assert Path(provisioning) == REPO / "deploy" / "grafana" / "provisioning" and ro
    (ds_file,) = (Path(provisioning) / "datasources").glob("*.yml")
    (source,) = yaml.safe_load(ds_file.read_text())["datasources"]
    url = urlsplit(source["url"])
    assert (url.hostname, url.port) == ("prometheus", 9090)
    assert "9090" in {str(p["target"]) for p in config["services"]["prometheus"]["ports"]}

    (dash_file,) = (Path(provisioning) / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(dash_file.read_text())["providers"]
    dashboards, ro = m[provider["options"]["path"]]
    assert Path(dashboards) == REPO / "deploy" / "grafana" / "dashboards" and ro
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (Path(dashboards) / Path(home).name).is_file()
    assert {str(p["target"]) for p in grafana["ports"]} == {"3000"}
