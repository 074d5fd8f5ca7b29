"""``selfrl serve`` as a subprocess for ``scripts/soak.py``: its config, start, ``kill -9``,
restart and stop; the admin calls; the server's RSS and the run directory's size."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key-0123456789abcdef"
SERVE_TOML = """\
run_dir = "{run_dir}"
port = {port}
max_tokens_default = {tokens}
batch_window_s = 0.05
[model]
name = "{model}"
[lora]
r = {lora_r}
[task]
source = "chain_sum"
[gate]
val_size = {val_size}
batch_size = {val_size}
[rollout]
max_new_tokens = {tokens}
max_turns = 2
[learner]
min_batch = {min_batch}
max_batch = {max_batch}
poll_s = 0.5
feedback_wait_s = {feedback_wait_s}
retry_s = 0.5
retry_max_s = 5.0
[collapse]
max_kl = {max_kl}
window_s = 1800.0
stable_s = 600.0
cooldown_s = 120.0
[retention]
keep_newest = {keep_newest}
keep_promoted = {keep_promoted}
delete = {delete}
[train]
learning_rate = {lr}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, path: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """GET (or POST ``body``) ``url + path`` under the API key; ``(status, JSON)``, status 0 when unreachable."""
    import httpx

    try:
        r = httpx.request("GET" if body is None else "POST", url + path, json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {KEY}"})
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


class Server:
    """``selfrl serve`` as a subprocess on one run directory: start, kill -9, restart, stop."""

    def __init__(self, out: Path, config: Path, fault_file: Path):
        self.out, self.config, self.fault_file = out, config, fault_file
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, port: int, timeout: float = 600.0) -> None:
        """Start it and wait for ``/health`` to answer.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` (its log's tail in the message).
        """
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "SELFRL_FAULT_FILE": str(self.fault_file),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        env.pop("SELFRL_FAULT", None)
        env.pop("SELFRL_API_KEY", None)
        self.starts += 1
        log = open(self.out / f"server-{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(self.config),
                                      "--api-key-file", str(self.out / "key")], env=env, stdout=log, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if call(self.url, "/health", timeout=5)[0] in (200, 503):
                return
            time.sleep(0.5)
        tail = (self.out / f"server-{self.starts}.log").read_text()[-2000:]
        raise RuntimeError(f"selfrl serve did not start (exit {self.proc.poll()}):\n{tail}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def disk_mb(folder: Path) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / 2**20
