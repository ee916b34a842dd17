"""Property-based fuzzing of every operation in our OpenAPI schema (schemathesis): no input yields a 5xx.

Bounded for CI: a few examples per operation, small caps (``max_tokens_cap``, ``max_n``) so the accepted
requests finish quickly on the scripted engine, and a request timeout so a hang fails instead of stalling.
"""

from __future__ import annotations

import schemathesis
from conftest import ApiServer
from hypothesis import HealthCheck, given, settings

from tests.worker.scripted_engine import InProcessWorker

MAX_EXAMPLES = 15


def test_no_input_makes_a_server_error(start_api: object, worker: InProcessWorker) -> None:
    api: ApiServer = start_api(max_tokens_cap=8, max_n=2, max_batch_size=4)  # type: ignore[operator]
    schema = schemathesis.openapi.from_url(f"{api.base_url}/openapi.json")
    failures: list[str] = []
    statuses: set[int] = set()
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=api.base_url, timeout=20)
            statuses.add(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code} "
                                f"{response.text[:300]}")

        check()
    assert operations >= 10
    assert {200, 400, 404} <= statuses  # the fuzzing reached both answered and refused requests
    assert failures == []
