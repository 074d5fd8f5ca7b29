"""The disk-full fault of ``scripts/fault_suite.py`` (``serve:disk_full``): ``selfrl serve`` as a
process, its run directory on a small tmpfs that fills up under rated traffic and is then
freed. Needs root (``mount -t tmpfs``); :func:`tmpfs_unavailable` says why not where it cannot
run, and :func:`serve_faults` leaves it out there. The traffic, the version checks and the
outcome are ``scripts/fault_serve.py``'s."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fault_serve import (
    SERVE_CLIENTS,
    SERVE_FAULTS,
    Response,
    ServeOutcome,
    _call,
    bad_served,
    serve_timeline,
    traffic,
)


def serve_faults() -> list[str]:
    """:data:`fault_serve.SERVE_FAULTS`, then ``disk_full`` where a tmpfs can be mounted (root);
    without one it is left out, with a note on stderr saying why."""
    with tempfile.TemporaryDirectory() as tmp:
        why = tmpfs_unavailable(Path(tmp))
    if why:
        print(f"fault_suite: serve:disk_full left out: {why}", file=sys.stderr)
        return list(SERVE_FAULTS)
    return [*SERVE_FAULTS, "disk_full"]


# -- a full disk under a selfrl serve process ---------------------------------------------

DISK_MB = 32  # the tmpfs the run directory lives on
DISK_CONFIG = """\
run_dir = "{run_dir}"
port = {port}
max_tokens_default = 8
batch_window_s = 0.02
[model]
name = "{model}"
[lora]
r = 4
[gate]
val_size = 4
batch_size = 4
[rollout]
max_new_tokens = 6
max_turns = 1
[learner]
min_batch = 4
max_batch = 8
poll_s = 0.1
feedback_wait_s = 4.0
retry_s = 0.2
retry_max_s = 1.0
[train]
learning_rate = 1e-3
beta = 0.05
[collapse]
max_kl = 0.1
"""
STORAGE_CODES = ("disk_full", "quota_exceeded", "database_locked", "read_only", "io_error")


def tmpfs_unavailable(work: Path) -> str | None:
    """Why a small tmpfs cannot be mounted under ``work`` (not root, no ``mount``, refused), or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    probe = Path(tempfile.mkdtemp(dir=work))
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True,
                           text=True)
        if r.returncode:
            return f"mount -t tmpfs was refused: {r.stderr.strip() or r.returncode}"
        subprocess.run(["umount", str(probe)], check=False)
        return None
    finally:
        probe.rmdir()


def fill_disk(folder: Path) -> Path:
    """Write a file into ``folder`` until its file system is full (``ENOSPC`` for a 64 KiB, then
    a 4 KiB write, a page of SQLite's); returns the file (delete it to free the space)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return filler


def _wait(check, timeout: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if check():
                return True
        except (OSError, KeyError, TypeError, ValueError):
            pass  # not up yet, or a field not there yet
        time.sleep(0.2)
    return False


def run_serve_disk_full(model_dir: Path, work: Path, timeout: float = 300.0) -> ServeOutcome:
    """``selfrl serve`` as a process, its run directory on a 32 MB tmpfs that fills up under rated
    traffic (three clients, every third request streamed), then is freed; see :func:`judge_disk_full`."""
    t0 = time.perf_counter()
    why = tmpfs_unavailable(work)
    if why:
        return ServeOutcome("serve:disk_full", False, f"not run: {why}")
    work = work / "serve_disk_full"
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    key = "fault-suite-key-0123456789"
    (work / "key").write_text(key + "\n")
    (work / "serve.toml").write_text(DISK_CONFIG.format(run_dir=disk / "run", port=port, model=model_dir))
    url, responses, probes, marks = f"http://127.0.0.1:{port}", [], {}, {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("SELFRL_API_KEY", None)
    env.pop("SELFRL_FAULT", None)

    @contextlib.contextmanager
    def traffic_on():
        stop = threading.Event()
        users = [threading.Thread(target=traffic, args=(url, key, k, stop, responses)) for k in range(SERVE_CLIENTS)]
        for u in users:
            u.start()
        try:
            yield
        finally:
            stop.set()
            for u in users:
                u.join(timeout=180)

    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)], check=True)
    proc = None
    try:
        with open(work / "server.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(work / "serve.toml"),
                                     "--api-key-file", str(work / "key")], env=env, stdout=log, stderr=log)
        if _wait(lambda: _call(url + "/health", None)[0] == 200, 180, proc):
            disk_full_scenario(url, key, disk, proc, traffic_on, responses, probes, marks, timeout)
        else:
            marks["error"] = "the server did not start: " + (work / "server.log").read_text()[-500:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            out = judge_disk_full(responses, probes, marks, disk / "run", (work / "server.log").read_text())
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    out.seconds = time.perf_counter() - t0
    return out


def disk_full_scenario(url: str, key: str, disk: Path, proc, traffic_on, responses: list[Response], probes: dict,
                       marks: dict, timeout: float) -> None:
    """The steps of :func:`run_serve_disk_full` against the running server at ``url``: what the
    clients got goes into ``responses`` and ``probes``, the times and states seen into ``marks``."""

    def learner() -> dict:
        return _call(url + "/admin/status", None, key)[2]["learner"]

    def chat(**body) -> tuple[int, Any, dict]:
        return _call(url + "/v1/chat/completions", {"model": "selfrl", "max_tokens": 4, **body})

    with traffic_on():  # 1. rated traffic until the learner has made a version
        _wait(lambda: learner()["last_update"].get("version", 0) >= 1, timeout, proc)
    # no update under way, fewer rated turns ready than an update takes: the next update the learner
    # tries is the one on the four unrated turns below, once their feedback_wait_s has passed, on a full disk
    _wait(lambda: not learner()["busy"] and _call(url + "/admin/status", None, key)[2]["turns"][
        "pending_with_feedback"] < 4, 60, proc)
    marks["version_before"] = learner()["last_update"].get("version", 0)
    unrated = [chat(messages=[{"role": "user", "content": f"unrated {i}"}], task_key="unrated")[2]["id"]
               for i in range(4)]
    filler = fill_disk(disk)
    marks["full"] = time.time()
    # 2. the disk is full: a stream first (refused before it starts once statvfs shows the disk full, else
    # ended by an error event when its turn cannot be stored), then each route
    probes["stream"] = chat(messages=[{"role": "user", "content": "q " * 200}], max_tokens=8, stream=True)
    probes["chat"] = chat(messages=[{"role": "user", "content": "q"}])
    probes["feedback"] = _call(url + "/v1/feedback", {"response_id": unrated[0], "rating": 1.0}, key)
    probes["responses"] = _call(url + "/v1/responses", {"model": "selfrl", "input": "hi", "max_output_tokens": 4})
    probes["health"] = _call(url + "/health", None)
    with traffic_on():
        marks["paused_seen"] = _wait(lambda: learner()["paused"]["code"] in STORAGE_CODES, 60, proc)
        time.sleep(1.0)
    probes["health_paused"] = _call(url + "/health", None)
    filler.unlink()  # 3. space is back
    marks["freed"] = time.time()
    marks["healthy_again"] = _wait(lambda: _call(url + "/health", None)[2]["status"] == "ok"
                                   and learner()["paused"] is None, 120, proc)
    marks["ok"] = time.time()
    probes["health_after"] = _call(url + "/health", None)
    with traffic_on():  # 4. it serves, records and learns again
        marks["learned_again"] = _wait(lambda: learner()["last_update"].get("version", 0)
                                       > marks["version_before"], timeout, proc)
    marks["learner_after"] = learner()


def judge_disk_full(responses: list[Response], probes: dict, marks: dict, run_dir: Path, log: str) -> ServeOutcome:
    """The verdict of :func:`run_serve_disk_full`. Recovered when: no request got a 500, a cut
    stream or an error outside the full disk's time; while full, requests were refused with a
    507/503 naming the fault (or a stream ended with such an error event and ``[DONE]``) and
    ``/health`` answered 503 ``degraded``; every response acknowledged with a 200 is stored
    (nothing acknowledged lost); the learner paused (one log line), resumed by itself (a log line
    and a ``learner_resumed`` event) and made a new version after space came back; ``/health``
    answered ``ok`` again; and no response named a bad version (:func:`bad_served`)."""
    from selfrl.record import served as records
    from selfrl.record.store import Store

    if "error" in marks:
        return ServeOutcome("serve:disk_full", False, marks["error"], notes=[marks["error"]])
    full, ok_at = marks.get("full", float("inf")), marks.get("ok", float("inf"))
    storage = [r for r in responses if any(c in r.error for c in STORAGE_CODES)]
    refused = [r for r in storage if full <= r.sent <= ok_at]
    failed = [r for r in responses if (r.status != 200 or r.error) and r not in refused]
    for name in ("stream", "chat", "feedback", "responses"):
        status, _, body = probes.get(name, (0, None, {"error": "not sent"}))
        if not (status in (503, 507) or "stream error" in body.get("error", "")) or not any(
                c in body.get("error", "") for c in STORAGE_CODES):
            failed.append(Response(full, full, status, error=f"{name} while full: {str(body)[:200]}"))
    with Store(run_dir / "selfrl.db", readonly=True) as store:
        rows = {v["version"]: v for v in store.versions()}
        events = store.events()
        by_traj = {t.id: t.adapter_version for t in store.trajectories()}
        acked = [r for r in responses if r.status == 200 and r.id]
        found = {r.id: records.find_response(store, r.id) for r in acked}
    lost = [r.id for r in acked if found[r.id] is None]
    sampled = {i: by_traj.get(row["trajectory_id"]) for i, row in found.items() if row is not None}
    bad = bad_served([r for r in acked if r.id in sampled], rows, serve_timeline(events), sampled)
    health = probes.get("health", (0, None, {}))
    paused = [r.get("code") for r in probes.get("health_paused", (0, None, {}))[2].get("reasons", [])]
    resumed = [e for e in events if e["kind"] == "learner_resumed"]
    problems = [
        *(["/health while full: " + str(health[2])[:200]] if health[0] != 503 or health[2].get("status")
          != "degraded" else []),
        *([] if "learner_paused" in paused else [f"/health while the learner was paused: {paused}"]),
        *([] if marks.get("paused_seen") else ["the learner was never seen paused"]),
        *([] if marks.get("healthy_again") else ["/health never answered ok again"]),
        *([] if resumed else ["no learner_resumed event"]),
        *([] if "background learner paused" in log and "background learner resumed" in log
          else ["no pause/resume lines in the server log"]),
        *([] if marks.get("learned_again") else ["no new version after space came back"]),
        *([f"{len(lost)} acknowledged turns lost"] if lost else []),
    ]
    stream = probes.get("stream", (0, None, {}))
    sent = len(responses) + 4 + sum(name in probes for name in ("stream", "chat", "feedback", "responses"))
    out = ServeOutcome("serve:disk_full", False, requests=sent, failed_requests=len(failed),
                       bad_versions_served=len(bad), versions={v: r["status"] for v, r in rows.items()},
                       events=[{"kind": e["kind"], "time": e["time"], "data": e["data"]} for e in events
                               if e["kind"] in ("learner_resumed", "promote", "reject", "swap", "collapse")],
                       notes=[*(r.error or f"HTTP {r.status}" for r in failed[:5]), *bad[:5], *problems],
                       responses=[asdict(r) for r in responses])
    paused_s = resumed[0]["data"]["paused_s"] if resumed else float("nan")
    how = ("ended with an error event" if "stream error" in stream[2].get("error", "")
           else f"refused with {stream[0]}")
    after = (marks.get("learner_after") or {}).get("last_update", {}).get("version")
    out.detail = (f"full for {marks.get('freed', full) - full:.0f} s: {len(refused)} of {len(responses)} traffic "
                  f"requests refused with 507/503, the first stream {how}, /health {health[0]}; learner paused "
                  f"{paused_s:.1f} s, then made version {after}; {len(lost)} acknowledged turns lost, "
                  f"{len(failed)} failed")
    out.recovered = not failed and not bad and not problems
    return out
