"""JSON over HTTP for the remote backends (standard library only), with a timeout per call.

A 4xx answer whose body says why becomes :class:`RemoteRequestError` (the backend
refused the request: bad arguments, an adapter that does not fit); anything else
that goes wrong (connection refused, 5xx, a broken body) is :class:`RemoteBackendError`;
a call that outlives its timeout raises ``TimeoutError``. :func:`unreachable` says why a
server does not answer a short GET (checked before a model loads). :func:`load_api_key` reads the
key both ends use (``selfrl serve`` and ``selfrl sampler`` check it, a run sends it).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path


class RemoteBackendError(RuntimeError):
    """The backend could not be reached or failed (connection, 5xx, unreadable answer)."""


class RemoteRequestError(ValueError):
    """The backend refused the request (4xx); the message is the backend's reason."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def call(base_url: str, path: str, body=None, *, timeout_s: float, api_key: str | None = None,
         raw: bytes | None = None, method: str | None = None):
    """Send ``body`` as JSON (or ``raw`` bytes) to ``base_url + path``; returns the decoded JSON
    answer (or its text when it is not JSON).

    Raises:
        RemoteRequestError: a 4xx answer.
        RemoteBackendError: no connection, a 5xx answer.
        TimeoutError: no answer within ``timeout_s``.
    """
    headers = {}
    data = None
    if raw is not None:
        data, headers["Content-Type"] = raw, "application/octet-stream"
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base_url.rstrip("/") + path, data=data, headers=headers,
                                 method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        detail = _detail(e.read().decode(errors="replace"))
        if 400 <= e.code < 500:
            raise RemoteRequestError(detail, e.code) from None
        raise RemoteBackendError(f"{base_url}{path}: HTTP {e.code}: {detail}") from None
    except (socket.timeout, TimeoutError) as e:
        raise TimeoutError(f"{base_url}{path}: no answer within {timeout_s:g} s") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise TimeoutError(f"{base_url}{path}: no answer within {timeout_s:g} s") from e
        raise RemoteBackendError(f"{base_url}{path}: {e.reason}") from e
    try:
        return json.loads(text)
    except ValueError:
        return text


def unreachable(base_url: str, path: str, timeout_s: float = 5.0) -> str | None:
    """Why ``GET base_url + path`` gets no 2xx answer within ``timeout_s`` seconds (no connection,
    no answer in time, an HTTP error: the reason in one line), or None when it does."""
    try:
        call(base_url, path, timeout_s=timeout_s)
    except RemoteRequestError as e:
        return f"{base_url.rstrip('/')}{path}: HTTP {e.status}: {e}"
    except (RemoteBackendError, TimeoutError, OSError) as e:
        return str(e)
    return None


def _detail(text: str) -> str:
    """The reason in an error body: FastAPI's ``detail``, OpenAI's ``error.message``, or the text."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(data, dict):
        if isinstance(data.get("detail"), str):
            return data["detail"]
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return text.strip()


def api_key_source(key_file: str | None = None) -> str:
    """Where :func:`load_api_key` reads the key from, as a message names it: the file, else the
    environment variable."""
    return f"the API key file {key_file}" if key_file else "the environment variable SELFRL_API_KEY"


def load_api_key(key_file: str | None = None) -> str | None:
    """The API key from ``key_file`` (first line) or ``SELFRL_API_KEY``; None when neither is set.

    Raises:
        ValueError: the file is unreadable or empty, or the key is shorter than 16 characters
            (the message says where it was read from).
    """
    key = None
    if key_file:
        try:
            lines = Path(key_file).read_text().strip().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read an API key from {key_file}: {e}") from e
        if not lines:
            raise ValueError(f"the API key file {key_file} is empty")
        key = lines[0].strip()
    elif os.environ.get("SELFRL_API_KEY"):
        key = os.environ["SELFRL_API_KEY"].strip()
    if key is not None and len(key) < 16:
        raise ValueError(f"the API key from {api_key_source(key_file)} is {len(key)} characters long; it must be "
                         "at least 16 (make one with: python -c 'import secrets; print(secrets.token_hex(16))')")
    return key
