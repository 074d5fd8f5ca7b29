"""Test helpers for ``selfrl serve``: a real uvicorn server on loopback around a tiny model."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
import urllib.error
import urllib.request

import torch

from selfrl.rl.logprobs import per_token_logps
from selfrl.serve.app import create_app
from selfrl.config.serve import ServeConfig
from selfrl.serve.service import Service

API_KEY = "test-key-0123456789abcdef"
CALC = {"type": "function", "function": {  # an OpenAI tool definition, as clients send it
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def tiny_serve_config(run_dir, **learner) -> ServeConfig:
    cfg = ServeConfig(run_dir=str(run_dir), max_tokens_default=16, batch_window_s=0.02)
    cfg.gate.val_size, cfg.gate.batch_size = 4, 4
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns = 6, 1
    for k, v in learner.items():
        setattr(cfg.learner, k, v)
    return cfg


def start_uvicorn(app) -> tuple[str, object, threading.Thread]:
    """Run ``app`` under uvicorn on a free 127.0.0.1 port in a daemon thread.

    Returns ``(base_url, server, thread)``; stop it with ``server.should_exit = True``.

    Raises:
        RuntimeError: the server did not start within 30 s.
    """
    import uvicorn

    from selfrl.serve.main import bind

    sock = bind("127.0.0.1", 0)  # bound here, so no other process can take the port in between
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


@contextlib.contextmanager
def running_server(model, tok, cfg: ServeConfig, learn: bool = False, api_key: str | None = API_KEY,
                   clock=time.time):
    """Yield ``(base_url, service)`` for a server on a free loopback port (``clock``: the
    ``Service``'s, e.g. the user simulator's fake one); stops it after."""
    service = Service(model, tok, cfg, learner_model=copy.deepcopy(model) if learn else None, clock=clock)
    url, server, thread = start_uvicorn(create_app(service, api_key, learn=learn))
    try:
        yield url, service
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def add_version(service: Service, state: dict, version: int, parent: int = 0, status: str = "promoted",
                metrics: dict | None = None) -> None:
    """Save ``state`` as a complete adapter version of ``service``'s run and record it."""
    from peft import set_peft_model_state_dict

    from selfrl.record import adapters

    holder = copy.deepcopy(service.engine.model)
    set_peft_model_state_dict(holder, state)
    with service.store.lock:
        path = adapters.save_version(holder, service.run_dir, version)
        service.store.add_version(version, parent, str(path), status, metrics or {})


def rated_turns(service: Service, n: int = 4) -> list[tuple]:
    """``n`` served turns of one group (``"arith"``), rated +1 / -1 in turn and stored as the
    server stores them: the ``(trajectory, info)`` batch a learner update takes."""
    from selfrl.record import served as records
    from selfrl.core.trajectory import Trajectory

    batch = []
    with service.store.lock:
        for i in range(n):
            t = Trajectory("arith", "arith", service.engine.version, prompt_len=3, token_ids=[5, 6, 7, 10 + i, 11],
                           completion_mask=[0, 0, 0, 1, 1], logprobs=[0.0] * 5)
            records.add_turn(service.store, service.run_id, t, t.id, 0, t.id, "arith", t.id)
            batch.append((t, {"feedback": (-1.0) ** i, "created_at": time.time(), "group_key": "arith"}))
    return batch


def http(method: str, url: str, body=None, raw: bytes | None = None, key: str | None = None) -> tuple[int, dict]:
    """A plain HTTP call (stdlib): returns ``(status, decoded JSON body)``."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def recomputed_logps(model, traj, temperature: float) -> torch.Tensor:
    """(n,) log-probs of the trajectory's completion tokens recomputed by ``model``."""
    ids = torch.tensor([traj.token_ids])  # (1, T)
    mask = torch.tensor([traj.completion_mask])  # (1, T)
    with torch.no_grad():
        out = per_token_logps(model, ids, torch.ones_like(ids), mask, temperature)[0]  # (T,)
    return out[mask[0].bool()]


SERVE_ENGINES = ["reference", "slots"]  # the serve tests that matter run on both backends


def serve_config(run_dir, engine: str = "reference", **learner) -> ServeConfig:
    """:func:`tiny_serve_config` served by ``engine``."""
    cfg = tiny_serve_config(run_dir, **learner)
    cfg.engine = engine
    return cfg


def patch_generate(monkeypatch, service, generate) -> None:
    """Make the serving engine answer through ``generate`` (an ``Engine.generate`` stand-in)
    from now on; for a continuous engine also through ``submit`` (what the batcher calls
    then), with ``on_tokens`` fed from ``generate``'s ``on_step`` as the engine would."""
    from concurrent.futures import Future

    monkeypatch.setattr(service.engine, "generate", generate)
    if not callable(getattr(service.engine, "submit", None)):
        return

    def submit(prompt, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, stop=None, on_tokens=None,
               seed=None, top_logprobs=0, step_logprobs=False, cancel=None):
        def on_step(ids, lps=None, top=None):  # (1, k) ids; (1, k) logprobs; (1, k, n) alternatives
            if not step_logprobs:
                return on_tokens(ids[0].tolist())
            alts = None if top is None else [list(zip(a[:top_logprobs], b[:top_logprobs]))
                                             for a, b in zip(top[0][0].tolist(), top[1][0].tolist())]
            return on_tokens(ids[0].tolist(), lps[0].tolist(), alts)

        extra = {"top_logprobs": top_logprobs, "step_logprobs": step_logprobs} if (top_logprobs or step_logprobs) else {}
        fut = Future()
        fut.set_result(generate([prompt], max_new_tokens, temperature, greedy, top_p,
                                on_step if on_tokens is not None else None, stop, **extra)[0])
        return fut

    monkeypatch.setattr(service.engine, "submit", submit)
