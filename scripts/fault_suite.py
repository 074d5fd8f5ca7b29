"""Fault-injection suite: poison, destroy and kill a tiny ``selfrl run``, then check that it recovered.

    .venv/bin/python scripts/fault_suite.py [--out runs/fault_suite.json] [--keep DIR]

Every fault runs ``selfrl run`` as a subprocess (``python scripts/fault_suite.py child ...``,
which registers the test reward ``short`` and calls ``selfrl.cli.main``) on a tiny
random Phi saved to a temporary folder, with ``SELFRL_FAULT`` set (see ``selfrl/faults.py``):

* ``lr_x1000@1``, ``noise@1``: a destructive update at iteration 1; recovered when a
  ``collapse`` event rolled that version back within one validation cycle and it is
  never served.
* ``nan_loss@1``: recovered when iteration 1's update was skipped as not finite and
  made no version.
* ``kill:<point>@1`` for every point of ``selfrl.faults.POINTS``: the process must die
  by SIGKILL; then ``--resume`` must finish the run; recovered when every trajectory
  stored before the kill is still there, byte for byte, and every version marked
  served (promoted or base) is complete (``adapters.verify_version``).

* ``serve:noise@1``, ``serve:lr_x1000@1``, ``serve:nan_loss@1``: the same faults in the
  second update of ``selfrl serve``'s background learner (in this process, uvicorn on
  loopback) while client threads keep sending rated chat requests; recovered when the
  collapse rules rolled the faulty candidate back (``nan_loss``: the update was skipped),
  every request got a 200, and every response named a version that existed, had been
  swapped in, is base or promoted, and is not older than the version served when it was
  sent (:func:`bad_served`).

Distributed faults (``selfrl run --ray local``, 2 rollout workers; only when Ray is installed; in
``scripts/fault_distributed.py``):

* ``worker:kill:<point>`` for each point of ``selfrl.distributed.worker.WORKER_FAULT_POINTS``
  (``before_sampling``, ``mid_rollout``, ``after_sending``): the first worker to reach the
  point SIGKILLs itself (``SELFRL_WORKER_FAULT``); ``worker:stop:mid_rollout`` SIGSTOPs it
  instead (alive and silent, as a worker partitioned from the driver), and the driver
  must time it out (``job_timeout_s``, 4 s; this run has one worker, so it cannot finish
  without) and replace it. Recovered when the run finishes
  with exactly one ``worker_lost``, every iteration trained ``num_prompts`` whole groups
  (trajectories lost: the groups missing), no group stored twice, every trained group
  within the staleness bound, and no corrupt version served.
* ``ray:kill:<point>@1``: the *driver* of a distributed run is SIGKILLed at a point of
  ``selfrl.faults.POINTS``, then ``--resume`` (with ``--ray``) must finish the run from
  the last good version: every trajectory stored before the kill unchanged, no group id
  stored twice, the ``resume`` event naming the version that was the newest servable one
  at the kill, and no corrupt version served.

It prints a table (faults injected, recovered, trajectories lost, corrupt versions
served; for serve: requests, failed requests, bad versions served) and writes the rows
as JSON. ``tests/test_faults.py`` and ``tests/test_serve_faults.py`` run the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
ITERATIONS = 3
FAULT_ITERATION = 1


def short(traj, ctx):
    """Test reward: 1 for an immediate EOS, 0 at the token limit of both turns (2 x 12 tokens).
    A random model never answers correctly; this one differs within groups, so updates happen."""
    return 1.0 - traj.num_completion_tokens / 24


# ------------------------------------------------------------------------- setup


def save_tiny_model(path: Path, seed: int = 0, eos_bias: float = 2.0) -> Path:
    """The tests' tiny Phi (``selfrl.testing``), saved as a local model folder."""
    from selfrl.testing import build_tiny_tokenizer, save_tiny_phi

    return save_tiny_phi(path, build_tiny_tokenizer(), seed, eos_bias)


CONFIG = """\
iterations = {iterations}
num_prompts = 2
num_generations = 4
reward_weights = {{ short = 1.0 }}
[model]
name = "{model}"
[lora]
r = 4
[task]
num_train = 40
[rollout]
max_new_tokens = 12
max_turns = 2
temperature = 0.7
[train]
learning_rate = 1e-3
beta = 0.05
micro_batch_size = 8
[gate]
val_size = 6
eval_every = 1
[collapse]
degenerate_rise = 0.6
"""
# degenerate_rise: the tiny random model's share of degenerate rollouts swings between 0.5 and
# 1.0 from one batch of 8 to the next, so the suite leaves that rule to the unit tests
# (tests/test_collapse.py); the destructive faults are caught by the KL rule.


DIST_CONFIG = CONFIG + """\
[distributed]
address = "local"
num_workers = {num_workers}
max_staleness = 1
worker_cpus = 0.5
job_timeout_s = {job_timeout_s}
"""
# job_timeout_s: a tiny model's job takes well under a second, even on 2 shared cores. The
# partition fault (a SIGSTOPped worker) runs with one worker and a 4 s timeout, so the run can
# only go on once the driver has timed the silent worker out and replaced it (with two, the
# other worker may finish the run first); every other fault gets 60 s, never reached.
PARTITION_TIMEOUT_S = 4.0


def write_config(path: Path, model_dir: Path, iterations: int = ITERATIONS, distributed: bool = False,
                 job_timeout_s: float = 60.0, num_workers: int = 2) -> Path:
    text = DIST_CONFIG if distributed else CONFIG
    path.write_text(text.format(iterations=iterations, model=model_dir, job_timeout_s=job_timeout_s,
                                num_workers=num_workers))
    return path


def run_child(args: list[str], fault: str | None = None, timeout: float = 300,
              worker_fault: str | None = None) -> subprocess.CompletedProcess:
    """``selfrl run <args>`` in a subprocess, with ``SELFRL_FAULT=fault`` (the driver's) and
    ``SELFRL_WORKER_FAULT=worker_fault`` (a Ray rollout worker's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RAY_memory_monitor_refresh_ms": "0"}  # Ray must not kill workers for others' memory use
    env.pop("SELFRL_FAULT", None)
    env.pop("SELFRL_WORKER_FAULT", None)
    if fault:
        env["SELFRL_FAULT"] = fault
    if worker_fault:
        env["SELFRL_WORKER_FAULT"] = worker_fault
    return subprocess.run([sys.executable, str(SCRIPT), "child", "run", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


# ----------------------------------------------------------------------- checks


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every stored trajectory, ``{id: data_json}`` (the exact stored text)."""
    db = run_dir / "selfrl.db"
    if not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT id, data_json FROM trajectories"))
    finally:
        conn.close()


def read_run(run_dir: Path) -> dict:
    """Versions, events and per-step metrics of a finished run (read with ``selfrl.store.Store``)."""
    from selfrl.store import Store

    with Store(run_dir / "selfrl.db") as store:
        metrics: dict[int, dict[str, float]] = {}
        for m in store.metrics():
            metrics.setdefault(m["step"], {})[m["name"]] = m["value"]
        return {"versions": store.versions(), "events": store.events(), "metrics": metrics}


def corrupt_served(run_dir: Path, versions: list[dict], final: int | None) -> list[int]:
    """Versions marked served (promoted or base) whose folder is not complete, plus the
    run's final served version ``final`` when its folder does not load with matching checksums."""
    from selfrl import adapters

    bad = [v["version"] for v in versions
           if v["status"] in ("promoted", "base") and adapters.verify_version(Path(v["path"])) is not None]
    if final is not None:
        try:
            adapters.load_version_state(adapters.version_dir(run_dir, final))  # verifies the checksums first
        except (adapters.CorruptVersionError, FileNotFoundError):
            bad.append(final)
    return sorted(set(bad))


def final_version(stdout: str) -> int | None:
    """The served version from ``selfrl run``'s last lines ("... (version N)"), or None."""
    m = re.search(r"\(version (\d+)\)\s*\nreport:", stdout)
    return int(m.group(1)) if m else None


@dataclass
class Outcome:
    """One injected fault and what became of it."""

    fault: str
    recovered: bool
    trajectories_lost: int = 0
    corrupt_versions_served: int = 0
    seconds: float = 0.0
    detail: str = ""
    notes: list[str] = field(default_factory=list)


def check_corrupting(fault: str, run_dir: Path, final: int | None) -> Outcome:
    """Judge a finished ``lr_x1000``, ``noise`` or ``nan_loss`` run whose served version is
    ``final`` (see the module docstring)."""
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    step = r["metrics"].get(FAULT_ITERATION, {})
    if fault.startswith("nan_loss"):
        ok = step.get("skip_reason_not_finite") == 1.0 and step.get("version") == step.get("sampled_version")
        return Outcome(fault, ok and not bad, corrupt_versions_served=len(bad),
                       detail="update skipped as not finite" if ok else f"iteration metrics {step}")
    made = int(step.get("version", -1))
    if made == int(step.get("sampled_version", -1)):
        return Outcome(fault, False, detail="the faulty update made no version")
    status = {v["version"]: v["status"] for v in r["versions"]}
    hits = [e for e in r["events"] if e["kind"] == "collapse" and made in e["data"].get("rolled_back", [])]
    cycle = 1  # gate.eval_every in CONFIG
    in_time = bool(hits) and hits[0]["data"]["iteration"] <= FAULT_ITERATION + cycle
    served = status.get(made) == "promoted" or final == made
    ok = in_time and not served and not bad
    rules = sorted({a["rule"] for e in hits for a in e["data"]["alarms"]})
    detail = (f"version {made} rolled back at iteration {hits[0]['data']['iteration']} by {', '.join(rules)}"
              if hits else f"version {made} not rolled back (status {status.get(made)})")
    return Outcome(fault, ok, corrupt_versions_served=len(bad), detail=detail)


def check_kill(fault: str, run_dir: Path, before: dict[str, str], final: int | None) -> Outcome:
    """Judge a run killed (with ``before`` stored then) and resumed to the end, serving
    ``final`` (see the module docstring)."""
    after = snapshot(run_dir)
    lost = sum(1 for k, v in before.items() if after.get(k) != v)
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    done = sorted(s for s, m in r["metrics"].items() if "reward/mean" in m)
    finished = done == list(range(ITERATIONS))
    recovered = [e["message"] for e in r["events"] if e["kind"] in ("recover", "corrupt_version")]
    ok = lost == 0 and not bad and finished
    detail = (f"{len(before)} trajectories before the kill, {len(after)} after resume; iterations {done}"
              + (f"; {len(recovered)} recovery events" if recovered else ""))
    return Outcome(fault, ok, lost, len(bad), detail=detail, notes=recovered)


def run_fault(fault: str, model_dir: Path, work: Path) -> Outcome:
    """Inject one fault into a fresh run under ``work``; returns its :class:`Outcome`."""
    t0 = time.perf_counter()
    run_dir = work / fault.replace(":", "_").replace("@", "_at_")
    config = write_config(work / f"{run_dir.name}.toml", model_dir)
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    if fault.startswith("kill:"):
        killed = run_child(args, fault)
        if killed.returncode != -signal.SIGKILL:
            return Outcome(fault, False, detail=f"not killed: exit {killed.returncode}: {killed.stderr[-400:]}")
        before = snapshot(run_dir)
        proc = run_child(["--config", str(config), "--resume", str(run_dir)])
    else:
        before, proc = {}, run_child(args, fault)
    if proc.returncode != 0:
        out = Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}")
    elif fault.startswith("kill:"):
        out = check_kill(fault, run_dir, before, final_version(proc.stdout))
    else:
        out = check_corrupting(fault, run_dir, final_version(proc.stdout))
    out.seconds = time.perf_counter() - t0
    return out


# ------------------------------------------------------------ serve under live traffic

SERVE_CLIENTS = 3  # client threads that keep sending while the learner trains
SERVE_UPDATES = 3  # learner updates to wait for: a clean one, the faulty one (FAULT_ITERATION), a clean one


@dataclass
class Response:
    """One request of the traffic: when it was sent and answered (``time.time()``), its HTTP
    status and the version the server said served it (header and body; None on failure)."""

    sent: float
    answered: float
    status: int
    version: int | None = None
    streamed: bool = False
    error: str = ""
    id: str = ""  # the response id (chatcmpl-...), when answered


def serve_config(model_dir: Path, run_dir: Path):
    """A tiny ``ServeConfig`` whose learner updates on every 8 rated turns and validates on 4 tasks."""
    from selfrl.serve.config import ServeConfig

    cfg = ServeConfig(run_dir=str(run_dir), max_tokens_default=8, batch_window_s=0.02)
    cfg.model.name, cfg.lora.r = str(model_dir), 4
    cfg.gate.val_size, cfg.gate.batch_size = 4, 4
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns = 6, 1
    cfg.learner.min_batch, cfg.learner.max_batch, cfg.learner.poll_s = 8, 8, 0.05
    cfg.learner.feedback_wait_s = 600.0  # only rated turns are trained on
    cfg.train.learning_rate, cfg.train.beta = 1e-3, 0.05
    cfg.collapse.max_kl = 0.1
    return cfg
# collapse.max_kl = 0.1: the served turns are short (4 to 7 tokens) and the learner's KL is taken at
# temperature 1, where the tiny random model is close to uniform, so a destroyed candidate measures a
# KL of 0.4 to 0.8 (noise, lr_x1000), against 0.002 to 0.005 for a clean update; 0.5 (the default)
# would sit inside the faulty range, 0.1 is 20 times the clean ones.


def _call(url: str, body: dict, key: str | None = None) -> tuple[int, Any, dict]:
    """POST ``body`` as JSON; returns (status, headers (case-insensitive), decoded body; for a
    stream the last chunk, with ``chunk_versions``: the versions all chunks named)."""
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as f:
            if not body.get("stream"):
                return f.status, f.headers, json.loads(f.read())
            chunks = [json.loads(line[6:]) for line in f.read().decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return f.status, f.headers, chunks[-1] | {"chunk_versions": {c["adapter_version"] for c in chunks}}
    except urllib.error.HTTPError as e:
        return e.code, e.headers, {"error": e.read().decode(errors="replace")[:300]}


def traffic(url: str, key: str, k: int, stop, out: list[Response]) -> None:
    """Client ``k``: chat requests (every third one streamed) until ``stop`` is set, each rated
    at once (+1 / -1 in turn) in one of two task groups, so the learner has groups to train on."""
    from selfrl.serve.app import VERSION_HEADER

    i = 0
    while not stop.is_set():
        body = {"model": "selfrl", "messages": [{"role": "user", "content": f"client {k} asks {i}"}],
                "max_tokens": 4 + i % 4, "task_key": f"group-{(k + i) % 2}", "stream": i % 3 == 0}
        r = Response(time.time(), 0.0, 0, streamed=body["stream"])
        try:
            r.status, headers, resp = _call(url + "/v1/chat/completions", body)
            r.answered = time.time()
            if r.status == 200:
                r.version, r.id = int(resp["adapter_version"]), resp["id"]
                said = {int(headers.get(VERSION_HEADER, -1)), *resp.get("chunk_versions", {r.version})}
                if said != {r.version}:
                    r.error = f"the header and the body name different versions: {sorted(said)}"
                fb, _, _ = _call(url + "/v1/feedback", {"response_id": resp["id"], "rating": 1.0 if i % 2 else -1.0},
                                 key)
                if fb != 200:
                    r.error = f"feedback: HTTP {fb}"
            else:
                r.error = resp.get("error", "")
        except Exception as e:  # noqa: BLE001 - every failure is counted, none is lost
            r.answered, r.error = time.time(), f"{type(e).__name__}: {e}"
        out.append(r)
        if r.error or r.status != 200:
            time.sleep(0.2)  # a broken server is reported, not hammered
        i += 1


def serve_timeline(events: list[dict]) -> list[tuple[float, int]]:
    """``(time, version)`` for each version the server swapped in (``swap`` events with
    ``served``), oldest first; version 0 serves from the start."""
    return [(0.0, 0)] + [(e["time"], e["data"]["version"]) for e in events
                         if e["kind"] == "swap" and e["data"].get("served", True)]


def bad_served(responses: list[Response], versions: dict[int, dict], timeline: list[tuple[float, int]],
               sampled: dict[str, int] | None = None) -> list[str]:
    """Responses that name a version which did not exist when they were answered, was never
    swapped in before they were answered, is not servable now (rejected, rolled back, a
    candidate), is older than the version served when they were sent (a request sent
    after a swap must get the new version), or is not the version the stored turn was
    sampled with (``sampled``: response id -> the trajectory's ``adapter_version``). One
    line each."""
    bad = []
    for i, r in enumerate(x for x in responses if x.version is not None):
        v, row = r.version, versions.get(r.version)
        if sampled is not None and sampled.get(r.id) != v:
            bad.append(f"response {i}: names version {v}, its turn was sampled on {sampled.get(r.id)}")
            continue
        swapped = [t for t, ver in timeline if ver == v]
        served_at_send = max((ver for t, ver in timeline if t <= r.sent), default=0)
        if row is None or row["created_at"] > r.answered:
            bad.append(f"response {i}: version {v} did not exist")
        elif row["status"] not in ("base", "promoted"):
            bad.append(f"response {i}: version {v} is {row['status']}")
        elif not swapped or min(swapped) > r.answered:
            bad.append(f"response {i}: version {v} was not yet served")
        elif v < served_at_send:
            bad.append(f"response {i}: sent while version {served_at_send} served, answered by version {v}")
    return bad


@dataclass
class ServeOutcome(Outcome):
    """A fault injected into ``selfrl serve``'s learner under live traffic."""

    requests: int = 0
    failed_requests: int = 0
    bad_versions_served: int = 0
    versions: dict = field(default_factory=dict)  # version -> status at the end
    events: list = field(default_factory=list)  # the collapse / skip / promote / swap events, in order
    responses: list = field(default_factory=list)  # every request's Response, as a dict


def run_serve_fault(fault: str, model_dir: Path, work: Path, clients: int = SERVE_CLIENTS,
                    updates: int = SERVE_UPDATES, timeout: float = 600.0) -> ServeOutcome:
    """Serve ``model_dir`` on loopback with ``SELFRL_FAULT=fault`` (in this process), keep
    ``clients`` threads sending rated chat requests until the learner has made ``updates``
    updates, then judge it: recovered when the faulty update's candidate was rolled back by a
    ``collapse`` event (``nan_loss``: skipped as not finite, no version), never served, every
    request answered 200 and no response named a bad version (:func:`bad_served`)."""
    import copy
    import threading

    import uvicorn

    from selfrl import faults
    from selfrl.model import build_policy
    from selfrl.serve import records
    from selfrl.serve.app import create_app
    from selfrl.serve.main import bind
    from selfrl.serve.service import Service

    t0 = time.perf_counter()
    run_dir = work / ("serve_" + fault.replace(":", "_").replace("@", "_at_"))
    cfg = serve_config(model_dir, run_dir)
    model, tok = build_policy(cfg)
    old = os.environ.get(faults.ENV)
    os.environ[faults.ENV] = fault
    key = "fault-suite-key-0123456789"
    service = Service(model, tok, cfg, learner_model=copy.deepcopy(model))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service, key, learn=True), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    responses: list[Response] = []
    stop = threading.Event()
    try:
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        users = [threading.Thread(target=traffic, args=(url, key, k, stop, responses)) for k in range(clients)]
        for u in users:
            u.start()
        deadline = time.monotonic() + timeout
        learner = service.learner
        while ((learner.updates < updates or learner.busy) and learner.error is None and time.monotonic() < deadline
               and sum(1 for r in responses if r.error or r.status != 200) < 20):
            time.sleep(0.1)
        time.sleep(0.5)  # traffic after the last update, on the version it left
        stop.set()
        for u in users:
            u.join(timeout=180)
        with service.store.lock:
            rows = {v["version"]: v for v in service.store.versions()}
            events = service.store.events()
            metrics = service.store.metrics()
            by_traj = {t.id: t.adapter_version for t in service.store.trajectories()}
            sampled = {}
            for r in responses:
                row = records.find_response(service.store, r.id) if r.id else None
                if row is not None:
                    sampled[r.id] = by_traj.get(row["trajectory_id"])
        error, done = learner.error, learner.updates
    finally:
        stop.set()
        server.should_exit = True
        thread.join(timeout=60)
        faults.set_iteration(-1)
        if old is None:
            os.environ.pop(faults.ENV, None)
        else:
            os.environ[faults.ENV] = old
    out = judge_serve(fault, responses, rows, events, metrics, error, done, updates, sampled)
    out.seconds = time.perf_counter() - t0
    return out


def judge_serve(fault: str, responses: list[Response], rows: dict[int, dict], events: list[dict],
                metrics: list[dict], error: str | None, done: int, updates: int,
                sampled: dict[str, int] | None = None) -> ServeOutcome:
    """The verdict of :func:`run_serve_fault` from what the server recorded."""
    failed = [r for r in responses if r.status != 200 or r.error]
    bad = bad_served(responses, rows, serve_timeline(events), sampled)
    kept = [e for e in events if e["kind"] in ("collapse", "skip", "promote", "reject", "swap")]
    out = ServeOutcome(f"serve:{fault}", False, requests=len(responses), failed_requests=len(failed),
                       bad_versions_served=len(bad), versions={v: r["status"] for v, r in rows.items()},
                       events=[{"kind": e["kind"], "time": e["time"], "data": e["data"]} for e in kept],
                       notes=[*(r.error or f"HTTP {r.status}" for r in failed[:5]), *bad[:5]],
                       responses=[asdict(r) for r in responses])
    made = {int(m["step"]): int(m["value"]) for m in metrics if m["name"] == "version"}  # update -> its candidate
    problem = error or (None if done >= updates else f"the learner made {done} of {updates} updates in time")
    if fault.startswith("nan_loss"):
        skips = [e for e in events if e["kind"] == "skip" and e["data"].get("iteration") == FAULT_ITERATION
                 and e["data"].get("reason") == "not_finite"]
        ok = bool(skips) and FAULT_ITERATION not in made
        out.detail = f"update {FAULT_ITERATION} skipped as not finite, no version made" if ok else "no not-finite skip"
    else:
        bad_one = made.get(FAULT_ITERATION)
        hits = [e for e in events if e["kind"] == "collapse" and bad_one in e["data"]["rolled_back"]]
        ok = bool(hits) and rows[bad_one]["status"] == "rolled_back"
        rules = sorted({a["rule"] for e in hits for a in e["data"]["alarms"]})
        out.detail = (f"version {bad_one} (update {FAULT_ITERATION}) rolled back by {', '.join(rules)}; serving "
                      f"version {hits[0]['data']['serving']}" if hits else
                      f"version {bad_one} (update {FAULT_ITERATION}) not rolled back")
    out.detail += f"; {len(responses)} requests, {len(failed)} failed, {len(bad)} bad versions served"
    if problem:
        out.detail += f"; {problem}"
    out.recovered = ok and not failed and not bad and not problem
    return out


def all_faults() -> list[str]:
    from selfrl.faults import POINTS

    return (["lr_x1000@1", "noise@1", "nan_loss@1"] + [f"kill:{p}@1" for p in POINTS]
            + [f"serve:{f}" for f in SERVE_FAULTS] + distributed().distributed_faults())


def distributed():
    """``scripts/fault_distributed.py`` (the Ray faults), loaded beside this file."""
    import importlib.util

    sys.modules.setdefault("fault_suite", sys.modules[__name__])  # it imports this module's helpers
    if "fault_distributed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fault_distributed", SCRIPT.parent / "fault_distributed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fault_distributed"] = module
        spec.loader.exec_module(module)
    return sys.modules["fault_distributed"]


SERVE_FAULTS = ("noise@1", "lr_x1000@1", "nan_loss@1")  # injected into selfrl serve's learner under traffic


def serve_table(outcomes: list[ServeOutcome]) -> str:
    """The serve faults' table and totals (plain text, Markdown-compatible)."""
    lines = ["| fault | recovered | requests | failed requests | bad versions served | seconds | detail |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {o.fault} | {'yes' if o.recovered else 'NO'} | {o.requests} | {o.failed_requests} | "
              f"{o.bad_versions_served} | {o.seconds:.0f} | {o.detail} |" for o in outcomes]
    lines += ["", "| serve faults injected | recovered | requests | failed requests | bad versions served |",
              "|---|---|---|---|---|",
              f"| {len(outcomes)} | {sum(o.recovered for o in outcomes)} | {sum(o.requests for o in outcomes)} | "
              f"{sum(o.failed_requests for o in outcomes)} | {sum(o.bad_versions_served for o in outcomes)} |"]
    return "\n".join(lines)


def table(outcomes: list[Outcome]) -> str:
    """The summary table and one line per fault (plain text, Markdown-compatible)."""
    lines = ["| fault | recovered | trajectories lost | corrupt versions served | seconds | detail |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {o.fault} | {'yes' if o.recovered else 'NO'} | {o.trajectories_lost} | "
              f"{o.corrupt_versions_served} | {o.seconds:.0f} | {o.detail} |" for o in outcomes]
    totals = (f"| {len(outcomes)} | {sum(o.recovered for o in outcomes)} | "
              f"{sum(o.trajectories_lost for o in outcomes)} | {sum(o.corrupt_versions_served for o in outcomes)} |")
    lines += ["", "| faults injected | faults recovered | trajectories lost | corrupt versions served |",
              "|---|---|---|---|", totals]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/fault_suite.json", help="where the JSON rows go")
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    p.add_argument("--faults", nargs="*", help="only these faults, e.g. noise@1 serve:noise@1 (default: all)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = save_tiny_model(work / "tiny-model")
        outcomes: list[Outcome] = []
        for fault in args.faults or all_faults():
            if fault.startswith("serve:"):
                outcomes.append(run_serve_fault(fault.removeprefix("serve:"), model_dir, work))
            elif fault.startswith(("worker:", "ray:")):
                outcomes.append(distributed().run_distributed_fault(fault, model_dir, work))
            else:
                outcomes.append(run_fault(fault, model_dir, work))
            print(f"{fault}: {'recovered' if outcomes[-1].recovered else 'NOT RECOVERED'} "
                  f"({outcomes[-1].seconds:.0f} s) {outcomes[-1].detail}", flush=True)
    runs = [o for o in outcomes if not isinstance(o, ServeOutcome)]
    serves = [o for o in outcomes if isinstance(o, ServeOutcome)]
    if runs:
        print(table(runs))
    if serves:
        print(serve_table(serves))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"faults_injected": len(outcomes), "faults_recovered": sum(o.recovered for o in outcomes),
               "trajectories_lost": sum(o.trajectories_lost for o in outcomes),
               "corrupt_versions_served": sum(o.corrupt_versions_served for o in outcomes),
               "serve_requests": sum(o.requests for o in serves),
               "serve_failed_requests": sum(o.failed_requests for o in serves),
               "serve_bad_versions_served": sum(o.bad_versions_served for o in serves)}
    out.write_text(json.dumps({"summary": summary, "faults": [asdict(o) for o in outcomes]}, indent=2))
    print(f"written: {out}")
    ok = summary["faults_recovered"] == summary["faults_injected"] and not summary["trajectories_lost"] \
        and not summary["corrupt_versions_served"] and not summary["serve_failed_requests"] \
        and not summary["serve_bad_versions_served"]
    return 0 if ok else 1


def child(argv: list[str]) -> int:
    """``selfrl`` with the test reward ``short`` registered (the subprocess side)."""
    from selfrl.cli import main as cli_main
    from selfrl.rewards import REWARD_FUNCS

    REWARD_FUNCS["short"] = short
    return cli_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
