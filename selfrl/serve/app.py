"""The HTTP layer of ``selfrl serve`` (FastAPI): routes, authentication, errors.

Routes:

* ``POST /v1/chat/completions`` — OpenAI chat completions (``stream`` via SSE).
* ``POST /v1/responses`` — the Responses API, served as a chat completion
  (``selfrl.serve.responses``).
* ``GET /v1/models`` — the served model and every base/promoted adapter version.
* ``POST /v1/feedback`` — a user's rating or correction of a response (API key).
* ``GET /admin/status``, ``POST /admin/pin``, ``POST /admin/unpin``,
  ``POST /admin/rollback`` — versions, queue, pending rewards; pin or roll back (API key).

Every response to a completion carries the adapter version that produced it, as the
``adapter_version`` field, in ``system_fingerprint`` (``selfrl-v<N>``) and in the
``X-Selfrl-Adapter-Version`` header.

Security: anyone who can post feedback can steer training, so feedback and admin
routes need ``Authorization: Bearer <key>``; the key comes from ``SELFRL_API_KEY`` or
a file (``--api-key-file``), is compared in constant time (``hmac.compare_digest``),
and without a configured key those routes answer 403. Completions are open unless
``protect_completions`` is set (they only ever add trajectories; rewards come from
feedback). Errors have OpenAI's shape ``{"error": {message, type, param, code}}``: a
bad request is a 400 naming its field (``param``, as ``messages[2].content[0].text``), an
exception nothing else handles a 500 ``server_error`` with its class and text (the
traceback goes to the server log only). A storage fault (disk full, quota spent, store
locked, read-only file system, ...) is a 507 or 503 whose ``code`` names it
(``disk_full``, ``database_locked``, ...), with ``Retry-After`` and what to do; a stream
that meets one after its first chunk ends with an error event and ``[DONE]``. While the
fault lasts, requests that record are refused before generating and ``GET /health``
answers 503 ``degraded`` (``selfrl.serve.health``).
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfrl.serve.feedback import client_identity
from selfrl.serve.health import health as health_of
from selfrl.serve.limits import BodyLimit
from selfrl.serve.errors import add_server_error_handler, error_body, validation_message
from selfrl.serve.feedback_request import FeedbackRequest
from selfrl.serve.protocol import ChatCompletionRequest, VersionRequest
from selfrl.serve.responses import ResponseLog, ResponsesRequest, create_response, sse, stream_events
from selfrl.serve.errors import ApiError
from selfrl.serve.service import Service, start_learning
from selfrl.serve.streaming import stream_chunks

VERSION_HEADER = "X-Selfrl-Adapter-Version"
log = logging.getLogger("selfrl.serve")


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def create_app(service: Service, api_key: str | None, protect_completions: bool = False,
               learn: bool = True) -> FastAPI:
    """The FastAPI application around ``service``.

    Args:
        api_key: the bearer token for feedback and admin routes (None: those routes are refused).
        protect_completions: require the key for completions and models too.
        learn: start the background learner with the app.
    """

    def require_key(request: Request) -> None:
        if api_key is None:
            raise ApiError(403, "feedback and admin routes are disabled: set SELFRL_API_KEY or --api-key-file",
                           code="no_api_key_configured", type_="permission_error")
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", type_="authentication_error")

    open_or_key = [Depends(require_key)] if protect_completions else []
    started = int(time.time())  # /v1/models: the aliases' ``created`` when their version is not listed
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if learn:
            start_learning(service)
        yield
        service.close()

    app = FastAPI(title="selfrl", lifespan=lifespan)

    app.add_middleware(BodyLimit, limit=service.cfg.max_request_bytes)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        if isinstance(e.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
            return _error(400, "the body nests objects and arrays too deeply to parse", code="body_too_deep")
        return _error(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError):
        message, where = validation_message(e.errors(), typed="content-type" in request.headers)
        return _error(400, message, param=where)

    add_server_error_handler(app, log, service.storage.failed)

    @app.post("/v1/chat/completions", dependencies=open_or_key)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        client = client_identity(request.headers.get("authorization"))
        if req.stream:
            version, lines = await stream_chunks(service, req, client)
            return StreamingResponse(lines, media_type="text/event-stream", headers={VERSION_HEADER: str(version)})
        resp = await service.complete(req, client, is_disconnected=request.is_disconnected)
        return JSONResponse(resp, headers={VERSION_HEADER: str(resp["adapter_version"])})

    responses_log = ResponseLog(service.store)

    @app.post("/v1/responses", dependencies=open_or_key)
    async def responses(req: ResponsesRequest, request: Request):
        client = client_identity(request.headers.get("authorization"))
        resp = await create_response(service, responses_log, req, client, request.is_disconnected)
        headers = {VERSION_HEADER: str(resp["adapter_version"])}
        if req.stream:
            return StreamingResponse(iter([sse(stream_events(resp))]), media_type="text/event-stream", headers=headers)
        return JSONResponse(resp, headers=headers)

    @app.get("/v1/models/{model_id:path}", dependencies=open_or_key)
    async def model(model_id: str):
        """One entry of ``GET /v1/models`` (``client.models.retrieve``); 404 naming the ids served."""
        listed = (await models())["data"]
        found = next((m for m in listed if m["id"] == model_id), None)
        if found is None:
            return _error(404, f"model {model_id!r} is not served here; the ids served: "
                          f"{', '.join(m['id'] for m in listed)}", param="model", code="model_not_found")
        return found

    @app.get("/v1/responses/{response_id}", dependencies=open_or_key)
    async def response_not_kept(response_id: str):
        return _error(404, f"retrieving a stored response ({response_id!r}) is not supported by selfrl serve: pass "
                      "its id as previous_response_id to continue its conversation", code="not_found")

    @app.get("/v1/models", dependencies=open_or_key)
    async def models():
        name, served, versions = service.cfg.served_model_name, service.engine.version, service.version_ids()
        # the aliases name the version serving now: created when it was (the server's start if unlisted)
        created = next((int(v["created_at"]) for v in versions if v["version"] == served), started)
        data = [{"id": n, "object": "model", "created": created, "owned_by": "selfrl",
                 "adapter_version": served, "base_model": service.cfg.model.name}
                for n in (name, *service.cfg.model_aliases)]
        for v in versions:
            data.append({"id": f"{name}@v{v['version']}", "object": "model", "created": int(v["created_at"]),
                         "owned_by": "selfrl", "adapter_version": v["version"], "status": v["status"],
                         "val_success": v["metrics"].get("val/success")})
        return {"object": "list", "data": data}

    @app.post("/v1/feedback", dependencies=[Depends(require_key)])
    async def feedback(f: FeedbackRequest):
        return service.feedback(f)

    @app.get("/admin/status", dependencies=[Depends(require_key)])
    async def status():
        return service.status()

    @app.post("/admin/pin", dependencies=[Depends(require_key)])
    async def pin(v: VersionRequest):
        import asyncio

        return await asyncio.to_thread(service.pin, v.version)

    @app.post("/admin/unpin", dependencies=[Depends(require_key)])
    async def unpin():
        import asyncio

        return await asyncio.to_thread(service.unpin)

    @app.post("/admin/rollback", dependencies=[Depends(require_key)])
    async def rollback(v: VersionRequest):
        import asyncio

        return await asyncio.to_thread(service.rollback, v.version)

    @app.get("/health")
    async def health():
        import asyncio

        status, body, headers = await asyncio.to_thread(health_of, service)  # a probe may write and fsync
        return JSONResponse(body, status_code=status, headers=headers)

    return app
