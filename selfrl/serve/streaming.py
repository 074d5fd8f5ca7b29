"""Server-sent events for ``stream: true``: OpenAI ``chat.completion.chunk`` objects.

Tokens are streamed as the batch decodes them (``Engine.generate``'s ``on_step``).
Text that may still turn out to be a tool call or a stop string is held back:
from the first ``<tool_call>`` (or stop string) on nothing more is streamed as
content, and the last few characters wait until they cannot start either. When the
generation ends, the rest of the content, the tool calls (one delta each, arguments
whole) and the finish reason follow, so the concatenated deltas equal the
non-streaming response. The recorded trajectory is the same as without streaming.

Content is cut from the text by the same rule as without streaming
(``split_completion``): a reasoning block is never streamed as content (a partial
``<think>``/``</think>`` tag at the end waits), and its text follows at the end as
one ``reasoning_content`` delta. With ``logprobs: true`` each content chunk carries
the ``logprobs.content`` entries of its own bytes (``Engine.generate``'s
``step_logprobs`` reports them as decoding goes; the same values as the final ones).
A client that disconnects mid-stream has its turn cut off (``selfrl.serve.disconnect``).
A generation that fails after the first chunk ends the stream with an OpenAI error event
(``data: {"error": {...}}``, which the ``openai`` client raises as ``APIError``) and
``[DONE]``; one that fails before is a 500, or a 400 when the request's own grammar failed
(``selfrl.serve.disconnect.generation_failed``). Any other failure after the first chunk
(the turn cannot be recorded: disk full, store locked) ends the stream the same way, with
the error the server would have answered (``selfrl.serve.errors.server_error``), never with
a cut body: the client is not told that a turn which was not stored succeeded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from selfrl.serve.errors import server_error
from selfrl.serve.disconnect import cut_off, generation_failed
from selfrl.serve.logprobs import (
    bytes_text,
    char_offsets,
    char_to_byte_spans,
    content_entries,
    slice_entries,
    token_bytes,
)
from selfrl.serve.protocol import ChatCompletionRequest, error_body, split_completion
from selfrl.serve.service import Service
from selfrl.chat.toolcall import THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN

log = logging.getLogger("selfrl.serve")


def safe_prefix(text: str, markers: list[str]) -> str:
    """The part of ``text`` that can be streamed as content now.

    >>> safe_prefix("The sum is <tool_call>{", ["<tool_call>"])
    'The sum is '
    >>> safe_prefix("The sum is <tool", ["<tool_call>"])
    'The sum is '
    >>> safe_prefix("abc\\ufffd", ["<tool_call>"])
    'abc'
    """
    cut = len(text)
    for m in markers:
        i = text.find(m)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(m) - 1, len(text)), 0, -1):  # a marker may be starting at the end
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    out = text[:cut]
    return out.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes as U+FFFD


def hold_partial_tags(text: str, tags: list[str]) -> str:
    """``text`` without a tag that may be starting at its end.

    >>> hold_partial_tags("ok </thi", [THINK_OPEN, THINK_CLOSE])
    'ok '
    """
    for m in tags:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                return text[:-k]
    return text


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def stream_chunks(service: Service, req: ChatCompletionRequest, client: str = "") -> tuple[int, AsyncIterator[str]]:
    """Start a streamed completion; returns the adapter version serving it (known once
    decoding has begun) and the SSE lines.

    Raises:
        ApiError: as :meth:`Service.prepare`, or 500 when the generation failed before its
            first token (before anything is streamed; 400 when the request's grammar failed).
    """
    p = await asyncio.to_thread(service.prepare, req, client)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    started: list[int] = []

    def on_tokens(i: int, ids: list[int], lps: list[float] | None = None, alts=None) -> None:
        # worker thread, inside the engine lock; ``lps``/``alts`` only with logprobs
        if not started:
            started.append(service.engine.version)
        loop.call_soon_threadsafe(queue.put_nowait, (i, ids, lps, alts))

    t0 = time.perf_counter()
    jobs = service.jobs(p, on_tokens)
    try:
        futures = [service.batcher.submit(j) for j in jobs]
    except RuntimeError as e:  # the batcher has stopped (the reason is in the message)
        raise generation_failed(jobs, e) from e
    done = asyncio.ensure_future(asyncio.gather(*[asyncio.wrap_future(f) for f in futures]))
    first_tokens = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait([done, first_tokens], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left before the first token
        cut_off(service, p, jobs, t0)
        raise
    if done.done() and done.exception() is not None:
        first_tokens.cancel()
        raise generation_failed(jobs, done.exception()) from done.exception()
    pending_first = first_tokens.result() if first_tokens.done() else None
    if not first_tokens.done():
        first_tokens.cancel()
    version = done.result()[0].adapter_version if done.done() else started[0]
    markers = [TOOL_CALL_OPEN, *req.stops]
    tok = service.tok
    # a template that opens the reasoning block in the prompt (Qwen3 with thinking on)
    opened = tok.decode(p.prompt[-8:], skip_special_tokens=False).rstrip().endswith(THINK_OPEN)
    base = {"id": p.response_id, "object": "chat.completion.chunk", "created": p.created,
            "model": service.cfg.served_model_name + (f"@v{version}" if p.version is not None else ""),
            "system_fingerprint": f"selfrl-v{version}",
            "adapter_version": version}

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        return _sse({**base, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

    async def lines() -> AsyncIterator[str]:
        sent = [""] * req.n
        sent_raw = [0] * req.n  # bytes of the logprob entries streamed so far, per choice
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})

        def emit(i: int, ids: list[int], lps: list[float] | None = None, alts=None) -> str | None:
            if req.logprobs and (lps is None or len(lps) != len(ids)):
                return None  # no logprobs for these ids: their content waits
            pieces = token_bytes(tok, ids)
            text = hold_partial_tags(safe_prefix(bytes_text(pieces), markers), [THINK_OPEN, THINK_CLOSE])
            prefix = THINK_OPEN if opened else ""
            parts = split_completion(prefix + text, [], service.control)
            safe = parts.content or ""
            if len(safe) > len(sent[i]) and safe.startswith(sent[i]):
                delta, sent[i] = safe[len(sent[i]):], safe
                logprobs = None
                if req.logprobs:
                    top = None
                    if alts is not None:
                        top = [[(token_bytes(tok, [t])[0], lp) for t, lp in a] for a in alts]
                    spans = [(max(0, s - len(prefix)), e - len(prefix)) for s, e in parts.spans]
                    entries = content_entries(pieces, lps, char_to_byte_spans(text, spans, char_offsets(
                        b"".join(pieces))), top)
                    total = sum(len(e["bytes"]) for e in entries)  # raw bytes of the content so far
                    logprobs = {"content": slice_entries(entries, sent_raw[i], total), "refusal": None}
                    sent_raw[i] = total
                return chunk(i, {"content": delta}, logprobs=logprobs)
            return None

        if pending_first is not None:
            line = emit(*pending_first)
            if line:
                yield line
        while not done.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait([done, getter], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                line = emit(*getter.result())
                if line:
                    yield line
            else:
                getter.cancel()
        recorded.append(True)
        if done.exception() is not None:  # the client gets the reason, not a cut connection
            err = generation_failed(jobs, done.exception())
            yield _sse(error_body(err.message, err.type, err.param, err.code))
            yield "data: [DONE]\n\n"
            return
        gens = done.result()
        resp = await asyncio.to_thread(service.finish, p, gens, time.perf_counter() - t0)
        for ch in resp["choices"]:
            i, msg = ch["index"], ch["message"]
            content = msg.get("content") or ""
            if msg.get("reasoning_content"):
                yield chunk(i, {"reasoning_content": msg["reasoning_content"]})
            if content.startswith(sent[i]) and len(content) > len(sent[i]):
                logprobs = None
                if ch.get("logprobs") is not None:
                    logprobs = {"content": slice_entries(ch["logprobs"]["content"], sent_raw[i], 1 << 62),
                                "refusal": None}
                yield chunk(i, {"content": content[len(sent[i]):]}, logprobs=logprobs)
            for k, call in enumerate(msg.get("tool_calls") or []):
                yield chunk(i, {"tool_calls": [{"index": k, **call}]})
            yield chunk(i, {}, ch["finish_reason"])
        if (req.stream_options or {}).get("include_usage"):
            yield _sse({**base, "choices": [], "usage": resp["usage"]})
        yield "data: [DONE]\n\n"

    recorded: list[bool] = []

    async def until_disconnect() -> AsyncIterator[str]:
        """``lines()``; a client that disconnects before the end has its turn cut off; a
        failure ends the stream with an error event and ``[DONE]``."""
        try:
            async for line in lines():
                yield line
        except (asyncio.CancelledError, GeneratorExit):
            if not recorded:
                cut_off(service, p, jobs, t0)
            raise
        except Exception as e:
            status, body, _ = server_error(e, service.storage.failed)
            if status == 500:
                log.error("a stream of %s failed", p.response_id, exc_info=e)
            yield _sse(body)
            yield "data: [DONE]\n\n"

    return version, until_disconnect()
