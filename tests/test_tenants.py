"""Each API key's policy: configured fields, the server-wide defaults for the rest, and a name safe to show."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.submission import rate_headers, reset_duration
from shared.config import Settings
from shared.queue import RateState
from shared.tenants import ANONYMOUS, owner_of


def test_a_keys_policy_takes_the_defaults_for_what_it_does_not_set() -> None:
    settings = Settings(api_keys=["sk-one", "sk-two"], rate_limit_rpm=60, rate_limit_jobs=10,
                        api_key_policies={"sk-one": {"name": "batch", "tpm": 1000, "weight": 3}})
    policies = settings.tenant_policies()

    one, two = policies.of(owner_of("sk-one")), policies.of(owner_of("sk-two"))

    assert (one.name, one.rpm, one.tpm, one.max_jobs, one.weight) == ("batch", 60, 1000, 10, 3.0)
    assert (two.name, two.rpm, two.tpm, two.max_jobs, two.weight) == (f"key-{owner_of('sk-two')[:8]}", 60, 0, 10, 1.0)
    assert policies.of(None).name == ANONYMOUS and policies.of(None).has_limits
    assert not Settings().tenant_policies().of(None).has_limits


def test_policies_are_validated_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPOOL_API_KEY_POLICIES", '{"sk-one": {"rpm": 5}}')
    assert Settings().api_key_policies["sk-one"].rpm == 5
    monkeypatch.setenv("TOKENSPOOL_API_KEY_POLICIES", '{"sk-one": {"weight": 0}}')
    with pytest.raises(ValidationError, match="weight"):
        Settings()
    monkeypatch.setenv("TOKENSPOOL_API_KEY_POLICIES", '{"sk-one": {"name": "has spaces"}}')
    with pytest.raises(ValidationError, match="name"):
        Settings()


def test_rate_headers_are_written_as_openai_writes_them() -> None:
    state = RateState(limit_requests=60, remaining_requests=59, reset_requests_s=1.0, limit_tokens=0,
                      remaining_tokens=0, reset_tokens_s=0.0)
    assert rate_headers(state) == {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                                   "x-ratelimit-reset-requests": "1s"}
    assert [reset_duration(s) for s in (0.02, 1.5, 360.0, 61.25)] == ["20ms", "1.5s", "6m0s", "1m1.25s"]
