"""The abuse suite's raw HTTP client (``scripts/abuse_suite.py``): plain requests that report
a status instead of raising, and a body sent chunk by chunk to see when the server stops
reading. Standard library only."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request


def request(base: str, method: str, path: str, body: bytes | None = None, key: str | None = None,
            headers: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """One HTTP call; returns ``(status, body)`` (status 0 when the connection failed)."""
    h = {"content-type": "application/json", **(headers or {})}
    if key:
        h["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=body if method == "POST" else None, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as f:
            return f.status, f.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def chat(base: str, messages: list[dict], key: str | None, **kw) -> tuple[int, dict]:
    status, raw = request(base, "POST", "/v1/chat/completions",
                          json.dumps({"model": "selfrl", "messages": messages, **kw}).encode(), key)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {}


def send_chunked(base: str, total: int, chunk: int = 64 * 1024, content_length: int | None = None,
                 wait_s: float = 30.0) -> tuple[int, int, bool]:
    """POST a ``total``-byte prompt to completions, chunked (or with a declared length), until
    the server answers or stops reading.

    Returns:
        (status, bytes the connection accepted, whether the server closed it after answering).
    """
    import select

    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=wait_s)
    framing = f"Content-Length: {content_length}" if content_length is not None else "Transfer-Encoding: chunked"
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"{framing}\r\n\r\n".encode())
    sent, reply = 0, b""
    piece = b'{"model": "selfrl", "messages": [{"role": "user", "content": "'
    pending = b""
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if not pending and sent < total:
                body = piece if sent == 0 else b"x" * min(chunk, total - sent)
                pending = body if content_length is not None else f"{len(body):x}\r\n".encode() + body + b"\r\n"
                sent += len(body)
            readable, writable, _ = select.select([sock], [sock] if pending else [], [], 1.0)
            if readable:
                reply = sock.recv(65536)
                break
            if writable:
                n = sock.send(pending)
                pending = pending[n:]
            elif not pending and sent >= total:
                continue  # everything is sent; wait for the answer
    except (BrokenPipeError, ConnectionResetError):
        pass
    if not reply:
        sock.settimeout(5)
        try:
            reply = sock.recv(65536)
        except OSError:
            reply = b""
    closed = False
    if reply:
        sock.settimeout(5)
        try:
            while True:
                more = sock.recv(65536)
                if not more:
                    closed = True
                    break
        except (TimeoutError, socket.timeout):
            closed = False
        except OSError:
            closed = True
    sock.close()
    accepted = sent - len(pending)
    status = int(reply.split(b" ")[1]) if reply.startswith(b"HTTP/") else 0
    return status, accepted, closed
