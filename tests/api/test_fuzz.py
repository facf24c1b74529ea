"""Fuzzing the service's own OpenAPI (schemathesis): no 5xx, and every answer as documented.

Every operation, with a token holding every scope. Schemathesis's pytest plugin starts the app's
lifespan for each operation and ends it after, so each start replays the event log the earlier
operations' fuzzing wrote: an event the service accepted but cannot read back fails every
operation after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.api.main import create_app
from app.core.config import Settings

TOKEN = "fuzz-token-with-every-scope"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def fuzz_settings(data_dir: Path) -> Settings:
    # No background loops: each request is the only thing the app does. Metrics and dashboard
    # behind the token too, so every operation goes through the token check.
    return Settings(
        data_dir=data_dir,
        log_fsync=False,
        max_batch_events=50,
        max_body_bytes=64 * 1024,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
        ingest_token=TOKEN,
        agent_token=TOKEN,
        admin_token=TOKEN,
        protect_observability=True,
        rate_limit_requests_per_second=0,
        rate_limit_events_per_second=0,
    )


# Loaded at import (schemathesis 4.32's lazy from_fixture fails under pytest 9), from an app that
# is never started and so writes nothing.
schema = schemathesis.openapi.from_dict(create_app(fuzz_settings(Path("unused"))).openapi())
# Otherwise negative cases drop or garble the bearer token, and about a third of the examples
# only ever reach the 401 (tests/api/test_auth.py covers that).
schema.config.generation.update(with_security_parameters=False)


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_app(fuzz_settings(tmp_path_factory.mktemp("fuzz")))


@schema.parametrize()
@settings(max_examples=100, deadline=None, derandomize=True, database=None)
def test_every_operation_answers_as_documented(case: schemathesis.Case, fuzz_app: FastAPI) -> None:
    case.call_and_validate(headers=AUTH, checks=CHECKS, app=fuzz_app)
    # /healthz would pass without the parts the lifespan builds.
    assert hasattr(fuzz_app.state, "engine"), "the app's lifespan did not run"
