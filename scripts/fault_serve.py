"""The serve faults of ``scripts/fault_suite.py``: a fault injected into ``selfrl serve``'s
background learner (in this process, uvicorn on loopback) while client threads keep
sending rated chat requests, and the verdict on every response's version. See that file's
docstring for what "recovered" means; it runs these."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fault_runs import FAULT_ITERATION, Outcome

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
    from selfrl.config.serve import ServeConfig

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


def _call(url: str, body: dict | None, key: str | None = None) -> tuple[int, Any, dict]:
    """POST ``body`` as JSON (GET when None); returns (status, headers (case-insensitive), decoded
    body; for a stream the last chunk, with ``chunk_versions``: the versions all chunks named).
    A stream that ends with an error event gives ``{"error": "stream error: <the event>"}``; one
    cut before ``[DONE]`` gives ``{"error": "cut: ..."}``."""
    import http.client
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as f:
            if not (body or {}).get("stream"):
                return f.status, f.headers, json.loads(f.read())
            try:
                data = [line[6:] for line in f.read().decode().splitlines() if line.startswith("data: ")]
            except http.client.IncompleteRead as e:
                return f.status, f.headers, {"error": f"cut: the stream ended without [DONE] ({e})"}
            if not data or data[-1] != "[DONE]":
                return f.status, f.headers, {"error": "cut: the stream ended without [DONE]"}
            chunks = [json.loads(d) for d in data[:-1]]
            if chunks and "error" in chunks[-1]:
                return f.status, f.headers, {"error": "stream error: " + json.dumps(chunks[-1]["error"])}
            return f.status, f.headers, chunks[-1] | {"chunk_versions": {c["adapter_version"] for c in chunks}}
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict) and "error" not in decoded:
            return e.code, e.headers, decoded  # a body that is no error (/health's 503 "degraded")
        return e.code, e.headers, {"error": text[:2000]}


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
            if r.status == 200 and "error" not in resp:
                r.version, r.id = int(resp["adapter_version"]), resp["id"]
                said = {int(headers.get(VERSION_HEADER, -1)), *resp.get("chunk_versions", {r.version})}
                if said != {r.version}:
                    r.error = f"the header and the body name different versions: {sorted(said)}"
                fb, _, said = _call(url + "/v1/feedback", {"response_id": resp["id"],
                                                           "rating": 1.0 if i % 2 else -1.0}, key)
                if fb != 200:
                    r.error = f"feedback: HTTP {fb}: {said.get('error', '')}"
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

    from selfrl.core import faults
    from selfrl.model.load import build_policy
    from selfrl.record import served as records
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


SERVE_FAULTS = ("noise@1", "lr_x1000@1", "nan_loss@1")  # injected into selfrl serve's learner under traffic
