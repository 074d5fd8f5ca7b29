"""SIGTERM and SIGHUP stop ``selfrl run``, ``selfrl serve`` and ``selfrl sampler`` as Ctrl-C does
(selfrl.run.shutdown): a graceful stop, then exit code 128 + the signal's number; a second signal
during the stop ends the process at once. Real subprocesses on a tiny model."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from selfrl.record.runlock import RunDirLock
from selfrl.run.shutdown import GracefulStop, StopRequested, exit_code

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import fault_runs as runs  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return runs.save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start_run(model_dir, run_dir: Path) -> tuple[subprocess.Popen, list[str]]:
    """``selfrl run`` (50 iterations: it is stopped long before) in a subprocess, returned once
    its second iteration has begun (the first update is stored)."""
    config = runs.write_config(run_dir.parent / "run.toml", model_dir, 50)
    proc = subprocess.Popen([sys.executable, str(runs.SCRIPT), "child", "run", "--config", str(config),
                             "--run-dir", str(run_dir)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration 1" in line:
            return proc, lines
    raise AssertionError(f"selfrl run ended ({proc.wait()}) before its second iteration:\n{''.join(lines)}")


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"did not stop within {timeout} s:\n{out[-3000:]}")
    return out


def closed_cleanly(db: Path) -> bool:
    """The store was closed (SQLite removes its -wal and -shm files at the last close) and is intact."""
    conn = sqlite3.connect(db)
    try:
        ok = conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    return ok


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_a_stop_signal_stops_selfrl_run_as_ctrl_c_does_and_exits_128_plus_it(sig, model_dir, tmp_path):
    # SIGTERM killed the run at once: no message, no report, the store left open
    run_dir = tmp_path / "run"
    proc, _ = start_run(model_dir, run_dir)
    proc.send_signal(sig)
    out = finish(proc)
    assert proc.returncode == exit_code(sig) == 128 + sig, out[-3000:]
    name = signal.Signals(sig).name
    assert f"selfrl: {name}: the run stops as on Ctrl-C" in out
    assert f"selfrl: stopped by {name}; continue with --resume" in out
    assert "interrupted: stored trajectories and versions are" in out  # the loop's own Ctrl-C path
    assert (run_dir / "report.md").is_file() and "Traceback" not in out
    assert not (run_dir / "selfrl.db-wal").exists() and closed_cleanly(run_dir / "selfrl.db")
    with sqlite3.connect(run_dir / "selfrl.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] >= 8  # iteration 0 kept


def test_a_second_sigterm_during_the_graceful_stop_ends_the_run_at_once(model_dir, tmp_path):
    proc, _ = start_run(model_dir, tmp_path / "run")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # the graceful stop (report, figures) takes seconds here
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, timeout=30)
    assert time.monotonic() - t < 5.0
    assert proc.returncode == 143 and "selfrl: SIGTERM again: stopping now" in out, out[-3000:]


SERVE = """
run_dir = "{run_dir}"
engine = "reference"
[model]
name = "{model}"
device = "cpu"
[lora]
r = 4
[learner]
min_batch = 4
max_batch = 4
[gate]
val_size = 4
batch_size = 4
[rollout]
max_new_tokens = 6
max_turns = 1
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up within {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_selfrl_serve_stops_gracefully_on_each_stop_signal(sig, model_dir, tmp_path):
    # SIGTERM: uvicorn stopped, then re-raised it (killed by the signal, no message); SIGINT: a
    # KeyboardInterrupt traceback; SIGHUP: killed at once, the learner and store never closed
    config = tmp_path / "serve.toml"
    config.write_text(SERVE.format(run_dir=tmp_path / "serve", model=model_dir))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(config), "--port",
                             str(port)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_up(proc, f"http://127.0.0.1:{port}/v1/models")
    proc.send_signal(sig)
    out = finish(proc)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, out[-3000:]
    assert f"selfrl: {name}: stopping: requests in flight finish, the learner stops, the store closes" in out
    assert f"selfrl: stopped by {name}" in out and "Traceback" not in out
    db = tmp_path / "serve" / "selfrl.db"
    assert not (tmp_path / "serve" / "selfrl.db-wal").exists() and closed_cleanly(db)
    RunDirLock(tmp_path / "serve").release()  # the lock is free: a restart can take the run directory


def test_selfrl_sampler_stops_gracefully_on_sigterm(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "sampler", "--model", str(model_dir), "--lora-r", "4",
                             "--port", str(port), "--device", "cpu"], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_up(proc, f"http://127.0.0.1:{port}/sampler/health")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 143 and "selfrl: sampler stopped by SIGTERM" in out, out[-3000:]


def test_graceful_stop_turns_a_signal_into_a_keyboard_interrupt_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested) as err, GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert isinstance(err.value, KeyboardInterrupt) and err.value.signum == signal.SIGTERM
    assert stop.received == signal.SIGTERM and stop.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before
