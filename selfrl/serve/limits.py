"""Limits enforced on a request before any work is done.

* :class:`BodyLimit` (ASGI middleware): the body limit applies to the bytes actually
  read, whatever the framing. A ``Content-Length`` over the limit gets a 413 before a
  byte of the body is read; a chunked body (no ``Content-Length``), or one that sends
  more than it declared, is read up to the limit and then refused with a 413 and
  ``Connection: close``, so the server never holds more than ``limit`` bytes of one
  request and the rest of it is never read.
* :func:`parse_version_suffix`: the ``@v<N>`` of a model name, parsed with bounds
  (Python refuses ``int()`` of a string over 4,300 digits; a version has at most
  :data:`MAX_VERSION_DIGITS`).
* :func:`check_text`: every string of a request body is valid Unicode that UTF-8 can
  encode (JSON may carry a lone surrogate, ``"\\ud800"``, that the tokenizer, the
  hash of a conversation and SQLite all refuse).
* :func:`too_deep`: a request body nests objects and arrays at most :data:`MAX_DEPTH`
  deep (a JSON schema 500 levels deep would exhaust Python's recursion in the schema
  code, the conversation hash and the grammar compiler).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_VERSION_DIGITS = 9
MAX_DEPTH = 100  # objects and arrays nested in one request body
VERSION_RE = re.compile(r"@v(\d+)$")


def parse_version_suffix(model: str) -> int | None:
    """The adapter version named by ``<name>@v<N>``, or None when there is no suffix.

    Raises:
        ValueError: the number has more than :data:`MAX_VERSION_DIGITS` digits.

    >>> parse_version_suffix("selfrl@v12"), parse_version_suffix("selfrl")
    (12, None)
    """
    m = VERSION_RE.search(model)
    if m is None:
        return None
    digits = m.group(1)
    if len(digits) > MAX_VERSION_DIGITS:
        raise ValueError(f"adapter version {digits[:12]}... has more than {MAX_VERSION_DIGITS} digits")
    return int(digits)


def check_text(value: Any, where: str = "body") -> None:
    """Raise ValueError when a string anywhere in ``value`` (dict keys included) cannot
    be encoded as UTF-8 (a lone surrogate). Walks iteratively, so any depth is safe."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"the {where} holds a string that is not valid Unicode (a lone surrogate)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> list[str | int] | None:
    """The path (keys and indices) to the first container nested deeper than ``limit``
    in ``value``, or None. Walks iteratively, so any depth is safe; only containers are
    visited, and the path is built only for the one that is too deep.

    >>> too_deep({"a": [[1]]}, 2)
    ['a', 0]
    >>> too_deep({"a": [1]}, 2) is None
    True
    """
    if not isinstance(value, (dict, list)):
        return None
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth >= limit:
            return _path_to(value, v, limit)
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return None


def _path_to(root: Any, target: Any, limit: int) -> list[str | int]:
    """The keys and indices from ``root`` to the container ``target`` (found at depth ``limit``)."""
    stack: list[tuple[Any, list[str | int]]] = [(root, [])]
    while stack:
        v, path = stack.pop()
        if v is target:
            return path
        if len(path) < limit and isinstance(v, (dict, list)):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((c, [*path, k]) for k, c in items if isinstance(c, (dict, list)))
    return []


class BodyLimit:
    """ASGI middleware: refuse a request body over ``limit`` bytes (see the module docstring).

    Args:
        app: the ASGI application.
        limit: the most body bytes one request may send.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, send, status: int, message: str, code: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or len(declared) > 15:
                return await self._refuse(send, 400, "invalid Content-Length header", "invalid_content_length")
            if int(declared) > self.limit:
                return await self._refuse(send, 413, f"the request body is {int(declared)} bytes; the limit is "
                                          f"{self.limit} bytes (max_request_bytes)", "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # the client left: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(send, 413, f"the request body exceeds the limit of {self.limit} bytes "
                                          "(max_request_bytes); the connection is closed", "request_too_large")
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as before

        return await self.app(scope, replay, send)
