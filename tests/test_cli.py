"""The ``tokenspool`` command line and the ``up`` supervisor (with real child processes, no mocks)."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from shared.config import Settings
from shared.launcher.cli import COMMAND_FIELDS, build_parser, build_settings, env_var, main, settings_table
from shared.launcher.redis_server import RedisServer, free_port
from shared.launcher.restart_policy import RestartPolicy
from shared.launcher.supervisor import ChildSpec, Supervisor
from shared.launcher.up import settings_env
from shared.logging_setup import configure_logging

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("api", "worker", "up", "models", "bench", "config")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TOKENSPOOL_* variable of the outer environment leaks into these tests."""
    for key in list(os.environ):
        if key.startswith("TOKENSPOOL_"):
            monkeypatch.delenv(key)


def settings_for(argv: list[str]) -> Settings:
    parser = build_parser()
    return build_settings(parser, parser.parse_args(argv))


# --- the command line -------------------------------------------------------------------------------------


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command}  " in out or f"    {command}\n" in out, command


def test_every_settings_field_is_a_flag_of_some_command() -> None:
    reachable = set().union(*COMMAND_FIELDS.values())
    assert reachable == set(Settings.model_fields)


def test_worker_flags_map_to_settings_fields() -> None:
    settings = settings_for([
        "worker", "--redis-url", "redis://127.0.0.1:1/0", "--model", "smollm2", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--block-size", "8", "--num-kv-blocks", "100", "--device", "cpu",
        "--dtype", "float32", "--speculative", "ngram", "--draft-model", "/models/draft",
        "--num-speculative-tokens", "3", "--metrics-port", "9100", "--drain-timeout", "7.5",
        "--no-enable-prefix-caching", "--worker-id", "w1", "--attention-backend", "sdpa", "--kv-cache-dtype",
        "float16", "--async-scheduling", "off",
    ])
    assert (settings.redis_url, settings.model, settings.max_num_seqs) == ("redis://127.0.0.1:1/0", "smollm2", 8)
    assert (settings.max_num_batched_tokens, settings.block_size, settings.num_kv_blocks) == (512, 8, 100)
    assert (settings.device, settings.dtype, settings.speculative) == ("cpu", "float32", "ngram")
    assert (settings.draft_model, settings.num_speculative_tokens, settings.metrics_port) == ("/models/draft", 3, 9100)
    assert (settings.drain_timeout_s, settings.enable_prefix_caching, settings.worker_id) == (7.5, False, "w1")
    from worker.main import engine_config  # torch: only here

    assert engine_config(settings).attention_backend == "sdpa"
    assert engine_config(settings).kv_cache_dtype == "float16"
    assert engine_config(settings).async_scheduling == "off"
    assert engine_config(settings_for(["worker"])).async_scheduling == "auto"
    assert engine_config(settings_for(["worker"])).kv_cache_dtype is None  # auto: the engine picks


def test_api_and_up_flags_map_to_settings_fields(tmp_path: Path) -> None:
    api = settings_for(["api", "--host", "0.0.0.0", "--port", "9000", "--api-keys", "k1, k2", "--redis-url", "redis://r"])
    assert (api.host, api.port, api.api_keys, api.redis_url) == ("0.0.0.0", 9000, ["k1", "k2"], "redis://r")
    up = settings_for(["up", "--port", "8001", "--model", "smollm2", "--workers", "2", "--data-dir", str(tmp_path)])
    assert (up.port, up.model, up.workers, up.data_dir, up.redis_url) == (8001, "smollm2", 2, tmp_path, None)


def test_env_var_applies_when_flag_absent_and_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPOOL_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("TOKENSPOOL_REDIS_URL", "redis://from-env")
    assert settings_for(["worker"]).max_num_seqs == 7
    assert settings_for(["worker"]).redis_url == "redis://from-env"
    assert settings_for(["worker", "--max-num-seqs", "3"]).max_num_seqs == 3
    assert settings_for(["worker"]).block_size == Settings.model_fields["block_size"].default


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["worker", "--max-num-seqs", "0"], {}, "--max-num-seqs: Input should be greater than or equal to 1"),
        (["api", "--port", "70000"], {}, "--port: Input should be less than or equal to 65535"),
        (["api"], {"TOKENSPOOL_PORT": "http"}, "TOKENSPOOL_PORT: Input should be a valid integer"),
        (["worker", "--attention-backend", "paged"], {}, "--attention-backend: String should match pattern"),
    ],
)
def test_bad_value_exits_2_naming_flag_or_env_var(
    argv: list[str], env: dict[str, str], expected: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_help_and_api_settings_do_not_import_torch() -> None:
    """`tokenspool --help`, each command's --help and the API process's imports stay free of torch."""
    code = textwrap.dedent("""
        import contextlib, importlib.util, io, sys
        from shared.launcher.cli import main
        for argv in (["--help"], ["api", "--help"], ["worker", "--help"], ["up", "--help"]):
            with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
                main(argv)
        main(["config"])
        if importlib.util.find_spec("api.main"):
            import api.main
        print("torch imported" if "torch" in sys.modules else "torch not imported")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("torch not imported")


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tokenspool"
    assert script.is_file(), "run `make setup` (pip install -e .) to install the tokenspool command"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: tokenspool" in result.stdout


def test_models_list_and_prepare_use_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.models import resolve_model

    folder = resolve_model("smollm2")  # converted by `make setup`; a cache hit here
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2" in listing and f"ready: {folder}" in listing
    started = time.monotonic()
    assert main(["models", "prepare", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert time.monotonic() - started < 5, "a cached model must not be converted again"


def test_models_prepare_missing_model_fails_with_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    assert main(["models", "prepare", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err


def test_bench_runs_the_benchmark_scripts(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offline", "--help"]) == 0
    assert "--workloads" in capfd.readouterr().out
    assert main(["bench", "api-relay", "--help"]) == 0
    assert "--step-ms" in capfd.readouterr().out
    assert main(["bench", "redis-capacity", "--help"]) == 0
    assert "--variant" in capfd.readouterr().out


def test_readme_settings_table_is_current() -> None:
    readme = (REPO / "README.md").read_text()
    begin, end = "<!-- settings-table:begin -->\n", "\n<!-- settings-table:end -->"
    assert begin in readme and end in readme, "README.md lost its settings table markers"
    table = readme.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == settings_table(), "README settings table is stale: paste in the output of `tokenspool config table`"
    for field in Settings.model_fields:
        assert f"`{env_var(field)}`" in table


def test_settings_env_round_trips_through_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`up` hands its settings to the API and workers as TOKENSPOOL_* variables; they must rebuild the same."""
    original = Settings(redis_url="redis://127.0.0.1:1/0", data_dir=tmp_path, api_keys=["a", "b"], max_num_seqs=5,
                        lease_ttl_s=2.5, enable_prefix_caching=False, metrics_port=None, speculative="ngram")
    for key, value in settings_env(original).items():
        if value:
            monkeypatch.setenv(key, value)
    assert Settings() == original


# --- structured logging (what `tokenspool api|worker|up` write to stderr) --------------------------------------


@pytest.fixture()
def json_log() -> Iterator[io.StringIO]:
    """Logging configured as the processes do, into a buffer; the root logger restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)
    try:
        yield stream
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_log_lines_are_json_with_extra_fields(json_log: io.StringIO) -> None:
    log = logging.getLogger("tokenspool.test")
    log.info("job %s finished", "job-1", extra={"job_id": "job-1", "folder": Path("/models/x")})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("claim failed\nfor job %s", "job-2", extra={"job_id": "job-2"})
    log.debug("debug is on")
    lines = json_log.getvalue().splitlines()
    assert len(lines) == 3  # one line per event, even with a newline and a traceback inside
    first, second, third = (json.loads(line) for line in lines)
    assert {k: first[k] for k in ("level", "logger", "msg", "job_id", "folder")} == {
        "level": "INFO", "logger": "tokenspool.test", "msg": "job job-1 finished", "job_id": "job-1",
        "folder": "/models/x"}
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert second["level"] == "ERROR" and second["msg"] == "claim failed\nfor job job-2"
    assert second["job_id"] == "job-2" and "ValueError: boom" in second["exc"]
    assert third["msg"] == "debug is on"


def test_configuring_twice_does_not_duplicate_lines(json_log: io.StringIO) -> None:
    configure_logging("WARNING", stream=json_log)
    logging.getLogger("tokenspool.test").info("hidden at WARNING")
    logging.getLogger("tokenspool.test").warning("shown")
    assert [json.loads(line)["msg"] for line in json_log.getvalue().splitlines()] == ["shown"]


def test_unknown_log_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="log_level must be one of"):
        configure_logging("LOUD")


# --- the `up` supervisor, with real processes ----------------------------------------------------------------

CHILD = """
import signal, sys, time
name, log, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
def stop(*_):
    time.sleep(delay)  # "draining"
    with open(log, "a") as f:
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(log + "." + name + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie no longer does)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def child(tmp_path: Path, name: str, delay: float = 0.0, script: str = CHILD, timeout: float = 5.0) -> ChildSpec:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    return ChildSpec(name, [sys.executable, str(path), name, str(tmp_path / "log"), str(delay)], dict(os.environ),
                     timeout)


def wait_ready(tmp_path: Path, *names: str) -> None:
    wait_for(lambda: all((tmp_path / f"log.{name}.ready").exists() for name in names))


def test_supervisor_stops_workers_before_api(tmp_path: Path) -> None:
    supervisor = Supervisor(child(tmp_path, "api"), [child(tmp_path, "w0", 0.5), child(tmp_path, "w1", 0.5)])
    supervisor.start()
    wait_ready(tmp_path, "api", "w0", "w1")
    supervisor.request_stop()
    assert supervisor.wait() == 0
    supervisor.stop()
    order = (tmp_path / "log").read_text().split()
    assert sorted(order[:2]) == ["w0", "w1"] and order[2:] == ["api"]
    assert all(proc.returncode == 0 for proc in supervisor.procs.values())


def test_supervisor_keeps_redis_up_while_workers_drain(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    drain = f"__import__('redis').Redis.from_url({server.url!r}).set('drained', name)"
    script = CHILD.replace("time.sleep(delay)", drain)
    supervisor = Supervisor(child(tmp_path, "api"), [child(tmp_path, "w0", script=script)], redis=server)
    supervisor.start()
    wait_ready(tmp_path, "api", "w0")
    supervisor.stop()
    assert not server.running
    assert (tmp_path / "log").read_text().split() == ["w0", "api"]
    with RedisServer(tmp_path / "redis", port=server.port):  # the AOF kept what the draining worker wrote
        assert redis.Redis.from_url(server.url).get("drained") == b"w0"


def test_supervisor_kills_a_stuck_child_and_its_children(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stuck = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen(["sleep", "300"])
        open(sys.argv[2] + ".grandchild", "w").write(str(grandchild.pid))
        while True:
            time.sleep(0.05)
    """)
    supervisor = Supervisor(None, [child(tmp_path, "w0", script=stuck, timeout=0.5)])
    supervisor.start()
    wait_for(lambda: (tmp_path / "log.grandchild").exists() and (tmp_path / "log.grandchild").read_text() != "")
    grandchild = int((tmp_path / "log.grandchild").read_text())
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shared.launcher.supervisor"):
        supervisor.stop()
    assert time.monotonic() - started < 5
    assert supervisor.procs["w0"].returncode == -signal.SIGKILL
    wait_for(lambda: not alive(grandchild), timeout_s=5)
    assert "w0 did not stop in time" in caplog.text


def test_supervisor_restarts_a_crashed_worker_until_a_crash_loop(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A worker that keeps dying is restarted after a backoff while the API stays up; its third crash within the
    window is a crash loop, which stops the stack."""
    crashing = "import sys, time; open(sys.argv[2] + '.starts', 'a').write('x'); time.sleep(0.3); sys.exit(3)"
    policy = RestartPolicy(backoff_s=0.2, max_crashes=2, window_s=60.0)
    supervisor = Supervisor(child(tmp_path, "api"), [child(tmp_path, "w0", script=crashing)], restart_policy=policy)
    supervisor.start()
    with caplog.at_level(logging.INFO, logger="shared.launcher.supervisor"):
        assert supervisor.wait(timeout_s=30) == 1
        assert supervisor.procs["api"].poll() is None  # the API stayed up throughout
    assert (tmp_path / "log.starts").read_text() == "xxx"
    assert caplog.text.count("exited with code 3 unexpectedly; restarting it in") == 2
    assert caplog.text.count("restarting w0") == 2
    assert "3 crashes within 60 s (a crash loop); shutting everything down" in caplog.text
    supervisor.stop()
    assert supervisor.procs["api"].returncode is not None


def test_supervisor_stops_everything_when_the_api_dies(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    crashing = "import sys, time; time.sleep(0.3); sys.exit(3)"
    supervisor = Supervisor(child(tmp_path, "api", script=crashing), [child(tmp_path, "w0")])
    supervisor.start()
    with caplog.at_level(logging.ERROR, logger="shared.launcher.supervisor"):
        assert supervisor.wait(timeout_s=10) == 1
    assert "api (pid" in caplog.text and "exited with code 3" in caplog.text
    supervisor.stop()
    assert supervisor.procs["w0"].returncode is not None


def test_children_get_sigterm_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    spec = child(tmp_path, "w0")
    program = textwrap.dedent(f"""
        import time
        from shared.launcher.supervisor import ChildSpec, Supervisor
        supervisor = Supervisor(None, [ChildSpec(*{(spec.name, spec.argv)!r}, {{}}, 5.0)])
        supervisor.start()
        open({str(tmp_path / "pid")!r}, "w").write(str(supervisor.procs["w0"].pid))
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", program], cwd=REPO)
    try:
        wait_ready(tmp_path, "w0")
        orphan = int((tmp_path / "pid").read_text())
        parent.kill()
        parent.wait()
        wait_for(lambda: not alive(orphan), timeout_s=10)
        assert (tmp_path / "log").read_text().split() == ["w0"]  # it got SIGTERM, not SIGKILL
    finally:
        parent.kill()


def test_up_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            main(["up", "--workers", "0", "--port", str(port), "--data-dir", str(tmp_path)])


def test_up_refuses_a_data_dir_in_use(tmp_path: Path) -> None:
    with open(tmp_path / "up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="another `tokenspool up` is using"):
            main(["up", "--workers", "0", "--port", str(free_port()), "--data-dir", str(tmp_path)])
