"""When a crashed worker is restarted: backoff doubling, reset after a stable run, and the crash-loop limit."""

from __future__ import annotations

from shared.launcher.restart_policy import CrashHistory, RestartPolicy

POLICY = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0, stable_after_s=60.0, max_crashes=4, window_s=100.0)


def test_backoff_doubles_up_to_its_cap_while_the_worker_keeps_crashing() -> None:
    history = CrashHistory(POLICY)
    delays = []
    for now in (1.0, 3.0, 7.0, 14.0):
        history.started(now - 0.5)
        restart_at = history.record_crash(now)
        assert restart_at is not None
        delays.append(restart_at - now)
    assert delays == [1.0, 2.0, 4.0, 5.0]


def test_a_stable_run_resets_the_backoff() -> None:
    history = CrashHistory(POLICY)
    history.started(0.0)
    assert history.record_crash(1.0) == 2.0
    history.started(2.0)
    assert history.record_crash(3.0) == 5.0  # 2 s backoff
    history.started(5.0)
    assert history.record_crash(5.0 + 61.0) == 66.0 + 1.0  # ran for 61 s: back to 1 s


def test_more_than_max_crashes_within_the_window_is_a_crash_loop() -> None:
    history = CrashHistory(POLICY)
    for now in (10.0, 20.0, 30.0, 40.0):
        history.started(now - 1)
        assert history.record_crash(now) is not None
    history.started(49.0)
    assert history.record_crash(50.0) is None  # the fifth within 100 s


def test_crashes_older_than_the_window_are_forgotten() -> None:
    history = CrashHistory(POLICY)
    for now in (10.0, 20.0, 30.0, 40.0, 150.0, 160.0):
        history.started(now - 1)
        assert history.record_crash(now) is not None
