"""``selfrl sampler``: a sampling backend as a separate process, reached over HTTP.

It serves one in-process engine (:class:`selfrl.engines.reference.Engine` over a peft model)
to other selfrl processes, which use it through :class:`selfrl.engines.remote.RemoteEngine`.
It is a CPU inference server: it runs wherever selfrl runs, returns
exact token ids and logprobs (the engine's own), and loads adapters by version.

Endpoints (JSON unless said otherwise; a refused request is a 400 whose ``detail``
says why and names the field, NaN and infinities included; an unexpected failure a 500
in OpenAI's error shape, its traceback in the server log; with an API key every
endpoint but ``/sampler/health`` needs ``Authorization: Bearer <key>``):

=====================================  ==============================================
``GET  /sampler/health``               ``{ok, version, backend, detail}``
``GET  /sampler/info``                 ``{version, eos_token_ids, model, context}``
``POST /sampler/generate``             ``{prompts, max_new_tokens, temperature, greedy,
                                       top_p, stop}`` -> ``{generations: [{token_ids,
                                       logprobs, finished, stopped, adapter_version}]}``;
                                       a prompt plus ``max_new_tokens`` beyond the
                                       model's context is a 400 naming the field (as
                                       ``selfrl serve``'s ``max_tokens``; no clamp)
``POST /sampler/adapters/{version}``   body: the LoRA state dict as safetensors bytes
``POST /sampler/adapters/{version}/load``  ``{path}``: a saved version folder on the
                                       server's file system (checksums verified)
``POST /sampler/logprobs``             ``{token_ids, temperature}`` -> ``{logprobs,
                                       version}``: each token given its prefix (the
                                       swap check's probe, :mod:`selfrl.safety.swap_check`);
                                       more ids than the context is a 400
=====================================  ==============================================
"""

import hmac
import logging

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from selfrl.engines.base import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SamplingEngine,
    check_token_ids,
    context_overflow,
    engine_context,
)
from selfrl.serve.errors import add_server_error_handler, finite_fields, validation_message

log = logging.getLogger("selfrl.sampler")


class GenerateRequest(BaseModel):
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    top_p: float = 1.0
    stop: list[str] | None = None

    _finite = finite_fields("max_new_tokens", "temperature", "top_p")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v and any(not s for s in v):
            raise ValueError("stop strings must be non-empty (an empty one would stop every row at once)")
        return v


class LoadRequest(BaseModel):
    path: str


class LogprobsRequest(BaseModel):
    token_ids: list[int] = Field(min_length=2)
    temperature: float = Field(default=1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)  # as for sampling

    _finite = finite_fields("temperature")


def create_sampler_app(engine: SamplingEngine, api_key: str | None = None, model_name: str = ""):
    """A FastAPI app serving ``engine`` (it must have ``.model`` for ``/sampler/logprobs``)."""
    def auth(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key")

    app = FastAPI(title="selfrl sampler")

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError):
        return JSONResponse({"detail": validation_message(e.errors(), typed="content-type" in request.headers)[0]},
                            status_code=400)

    add_server_error_handler(app, log)

    @app.get("/sampler/health")
    def health() -> dict:
        h = engine.health()
        return {"ok": h.ok, "version": h.version, "backend": h.backend, "detail": h.detail}

    context = engine_context(engine)

    @app.get("/sampler/info", dependencies=[Depends(auth)])
    def info() -> dict:
        return {"version": engine.version, "eos_token_ids": list(engine.eos_token_ids), "model": model_name,
                "context": context}

    @app.post("/sampler/generate", dependencies=[Depends(auth)])
    def generate(req: GenerateRequest) -> dict:
        if context is not None and req.prompts:  # as selfrl serve's max_tokens: refused, never clamped
            longest = max(range(len(req.prompts)), key=lambda i: len(req.prompts[i]))
            overflow = context_overflow(len(req.prompts[longest]), req.max_new_tokens, context,
                                        f"prompts[{longest}]", "max_new_tokens")
            if overflow is not None:
                raise HTTPException(400, f"{overflow[0]} (at {overflow[1]})")
        try:
            gens = engine.generate(req.prompts, req.max_new_tokens, temperature=req.temperature, greedy=req.greedy,
                                   top_p=req.top_p, stop=req.stop)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        return {"generations": [{"token_ids": g.token_ids, "logprobs": g.logprobs, "finished": g.finished,
                                 "stopped": g.stopped, "adapter_version": g.adapter_version} for g in gens]}

    @app.post("/sampler/adapters/{version}", dependencies=[Depends(auth)])
    async def swap_bytes(version: int, request: Request) -> dict:
        from safetensors.torch import load

        body = await request.body()
        try:
            state = load(body)
        except Exception as e:  # a body that is not safetensors is the client's mistake
            raise HTTPException(400, f"the body is not a safetensors LoRA state dict: {e}") from e
        return _swap(state, version)

    @app.post("/sampler/adapters/{version}/load", dependencies=[Depends(auth)])
    def swap_folder(version: int, req: LoadRequest) -> dict:
        return _swap(req.path, version)

    def _swap(adapter, version: int) -> dict:
        try:
            seconds = engine.swap(adapter, version)
        except (ValueError, FileNotFoundError) as e:
            raise HTTPException(400, str(e)) from e
        return {"version": engine.version, "seconds": seconds}

    @app.post("/sampler/logprobs", dependencies=[Depends(auth)])
    def logprobs(req: LogprobsRequest) -> dict:
        from selfrl.rl.logprobs import sequence_logprobs

        try:
            check_token_ids([req.token_ids], engine.model.get_input_embeddings().weight.shape[0])
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        if context is not None and len(req.token_ids) > context:  # as a prompt: a model with learned
            raise HTTPException(400, f"token_ids holds {len(req.token_ids)} tokens; this model's context is "
                                     f"{context} tokens (at token_ids)")  # positions would fail on it
        with engine.lock:  # one version from start to end, as a generation
            synced = getattr(engine, "synced_model", None)  # a slot engine scores with the view it samples with
            model = synced() if synced else engine.model
            return {"logprobs": sequence_logprobs(model, req.token_ids, req.temperature),
                    "version": engine.version}

    return app
