"""The fleet history behind the console's charts: rates between heartbeats, summed over workers, and latency means
over the last interval; a repeated heartbeat repeats the rate, a restarted worker starts again from zero."""

from __future__ import annotations

import pytest

from api.fleet import FleetSnapshot
from api.fleet_history import FleetHistory, next_rate
from shared.schemas import WorkerInfo, WorkerTotals


def info(worker_id: str, at: float, tokens: int, firsts: int = 0, ttft: float = 0.0, done: int = 0,
         e2e: float = 0.0, running: int = 0) -> WorkerInfo:
    return WorkerInfo(id=worker_id, model="m", max_num_seqs=8, num_running=running, heartbeat_at=at, started_at=0.0,
                      totals=WorkerTotals(num_generated_tokens=tokens, num_first_tokens=firsts, ttft_sum_s=ttft,
                                          num_finished_jobs=done, e2e_sum_s=e2e))


def snapshot(*workers: WorkerInfo, queued: int = 0) -> FleetSnapshot:
    return FleetSnapshot({"m": {0: queued}}, workers, 0)


def test_rates_are_differences_between_heartbeats_summed_over_workers() -> None:
    history = FleetHistory(interval_s=1.0)
    first = history.add(snapshot(info("a", 10.0, 100), info("b", 10.0, 0), queued=3), at=1.0)
    assert first.tokens_per_s == 0 and first.num_queued == 3 and first.mean_ttft_s is None
    point = history.add(snapshot(info("a", 12.0, 300, firsts=2, ttft=1.0, done=1, e2e=4.0, running=2),
                                 info("b", 11.0, 50, firsts=2, ttft=3.0)), at=2.0)
    assert point.tokens_per_s == pytest.approx(100 + 50)
    assert point.jobs_per_s == pytest.approx(0.5)
    assert point.mean_ttft_s == pytest.approx(1.0)  # (1.0 + 3.0) s over 4 first tokens
    assert point.mean_e2e_s == pytest.approx(4.0)
    assert point.num_running == 2
    assert history.tokens_per_s("a") == pytest.approx(100) and history.tokens_per_s("nobody") == 0
    assert [p.at for p in history.points()] == [1.0, 2.0]


def test_a_repeated_heartbeat_repeats_the_rate() -> None:
    history = FleetHistory(interval_s=1.0)
    history.add(snapshot(info("a", 10.0, 0)), at=1.0)
    history.add(snapshot(info("a", 11.0, 40)), at=2.0)
    assert history.add(snapshot(info("a", 11.0, 40)), at=3.0).tokens_per_s == pytest.approx(40)


def test_a_restarted_or_vanished_worker_starts_from_zero() -> None:
    before = next_rate(None, info("a", 10.0, 500))
    restarted = next_rate(before, info("a", 11.0, 20))
    assert restarted is not None and restarted.tokens_per_s == 0 and restarted.totals.num_generated_tokens == 20
    assert next_rate(None, WorkerInfo(id="old", model="m", max_num_seqs=1, heartbeat_at=1.0, started_at=0.0)) is None
    history = FleetHistory(interval_s=1.0)
    history.add(snapshot(info("a", 10.0, 0)), at=1.0)
    history.add(snapshot(info("a", 11.0, 40)), at=2.0)
    assert history.add(snapshot(), at=3.0).tokens_per_s == 0
    assert history.add(snapshot(info("a", 12.0, 80)), at=4.0).tokens_per_s == 0  # first sighting again


def test_history_keeps_the_last_window_only() -> None:
    history = FleetHistory(interval_s=1.0, window_s=5.0)
    for t in range(12):
        history.add(snapshot(), at=float(t))
    assert [p.at for p in history.points()] == [7.0, 8.0, 9.0, 10.0, 11.0]
