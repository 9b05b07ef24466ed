"""schemathesis against the service's own OpenAPI schema: no 500s, every answer matches its schema.

Examples are bounded (hypothesis max_examples) and the server's limits are set
low, so that generated plans stay small and quick.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")
schemathesis = pytest.importorskip("schemathesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api import Settings, create_app  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    directory = tmp_path_factory.mktemp("schemathesis")
    app = create_app(
        Settings(
            db_path=directory / "plans.sqlite3",
            solve_processes=1,
            queue_size=4,
            max_body_bytes=512 * 1024,
            max_nodes=60,
            max_time_limit_s=2,
            default_time_limit_s=1,
            max_solver_workers=1,
            max_wait_s=1,
            default_wait_s=0.2,
        )
    )
    with TestClient(app):  # runs the lifespan: store, solve process
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_its_contract(case):
    case.call_and_validate(checks=CHECKS)
