"""Schemathesis fuzzes every operation of the OpenAPI spec against a real uvicorn: no 5xx.

Bounded for CI: ``TUNER_SCHEMATHESIS_EXAMPLES`` examples per operation (default 25).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from server.live import ThreadServer

pytestmark = pytest.mark.timeout(600)
EXAMPLES = int(os.environ.get("TUNER_SCHEMATHESIS_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with ThreadServer(tmp_path_factory.mktemp("fleet") / "fleet.db") as srv:
        yield srv.url, srv.token("fuzzer", "admin")


@pytest.fixture(scope="module")
def api_schema(live: tuple[str, str]):
    return schemathesis.openapi.from_url(live[0] + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live: tuple[str, str]) -> None:
    url, token = live
    case.call_and_validate(
        base_url=url,
        headers={"Authorization": f"Bearer {token}"},
        checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
    )  # fmt: skip
