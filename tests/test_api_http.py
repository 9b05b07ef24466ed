"""HTTP rules every route of the service follows, in-process (FastAPI TestClient).

Bearer tokens are compared as UTF-8 bytes; request bodies are JSON only (415
otherwise, so that a cross-origin "simple request" queues nothing); `Allow`
names every method of a path on 405 and OPTIONS; /docs works with no network.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")

from fastapi.testclient import TestClient  # noqa: E402

from api import Settings, create_app  # noqa: E402
from api.examples import EXAMPLE_PROFILE  # noqa: E402

TOKEN = "clé-секрет-🔑"  # not ASCII, not even latin-1


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("http")
    settings = Settings(db_path=directory / "plans.sqlite3", solve_processes=1, request_processes=1, max_solver_workers=1)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("http-token")
    settings = Settings(db_path=directory / "plans.sqlite3", solve_processes=1, request_processes=1, max_solver_workers=1,
                        token=TOKEN)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def bearer(token: str, encoding: str = "utf-8") -> dict[str, bytes]:
    return {"Authorization": b"Bearer " + token.encode(encoding)}


# Tokens -------------------------------------------------------------------------------


def test_a_non_ascii_token_can_be_presented_as_utf8(guarded):
    assert guarded.get("/v1/plans", headers=bearer(TOKEN)).status_code == 200
    assert guarded.get("/metrics", headers=bearer(TOKEN)).status_code == 200


def test_a_wrong_or_mis_encoded_token_is_refused(guarded):
    assert guarded.get("/v1/plans").status_code == 401
    assert guarded.get("/v1/plans", headers=bearer(TOKEN[:-1])).status_code == 401
    assert guarded.get("/v1/plans", headers=bearer(TOKEN + "x")).status_code == 401
    # The same characters in another encoding are other bytes: refused, never a 500.
    assert guarded.get("/v1/plans", headers=bearer(TOKEN, "utf-16")).status_code == 401
    assert guarded.get("/v1/plans", headers={"Authorization": b"Bearer \xff\xfe"}).status_code == 401
    assert guarded.get("/v1/plans", headers={"Authorization": b"Basic " + TOKEN.encode()}).status_code == 401
