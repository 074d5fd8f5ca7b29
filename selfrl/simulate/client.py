"""The simulator's HTTP side: the ``openai`` client for completions, ``httpx`` for feedback.

Every call returns a :class:`Reply` and never raises for what the server answers: a 4xx or
5xx is a status to record, a refused connection or a timeout is status 0 with the error's
text. The clients never retry (``max_retries=0``), so one call is one request.

Each user sends its own bearer token on completions (``simuser-<seed>-<user id>``), as
separate end users of one application would: the server tells clients apart by it (a
conversation links, and its next message reads as a correction, only within one client).
With ``per_user_tokens = false`` every user sends the API key instead (a server started with
``--protect-completions`` needs that). Feedback always carries the API key, which the route needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai


@dataclass
class Reply:
    """What one request got: HTTP ``status`` (0: no answer, or an answer that is not JSON), real ``latency_s``, the JSON body
    (None when there was none) and, for a failure, the error's text."""

    status: int
    latency_s: float
    body: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class Refusal:
    """Why the server cannot be used (one line), and the exit code of ``selfrl simulate`` for it
    (``selfrl.cli.EXIT_CODES``: 1 the server is not there or fails, 2 the input is wrong)."""

    message: str
    exit_code: int


class Client:
    """Completions and feedback against ``base_url`` (a ``selfrl serve``).

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000``.
        api_key: the server's API key (feedback; completions too without ``per_user_tokens``).
        seed: part of each user's token (two simulations with other seeds are other clients).
        timeout_s: real seconds one request may take.
        per_user_tokens: see the module docstring.
    """

    def __init__(self, base_url: str, api_key: str, seed: int = 0, timeout_s: float = 300.0,
                 per_user_tokens: bool = True):
        self.base_url = base_url.rstrip("/")
        self.api_key, self.seed, self.per_user_tokens = api_key, seed, per_user_tokens
        self.http = httpx.Client(timeout=timeout_s)
        self._openai: dict[str, openai.OpenAI] = {}

    def _client(self, user: str) -> openai.OpenAI:
        token = f"simuser-{self.seed}-{user}" if self.per_user_tokens else self.api_key
        if token not in self._openai:
            self._openai[token] = openai.OpenAI(base_url=self.base_url + "/v1", api_key=token, max_retries=0,
                                                http_client=self.http)
        return self._openai[token]

    def chat(self, user: str, body: dict[str, Any]) -> Reply:
        """``POST /v1/chat/completions`` with ``body`` (its ``task_key`` goes in ``extra_body``)."""
        kwargs = {k: v for k, v in body.items() if k != "task_key"}
        extra = {"task_key": body["task_key"]} if "task_key" in body else None
        t0 = time.perf_counter()
        try:
            raw = self._client(user).chat.completions.with_raw_response.create(**kwargs, extra_body=extra)
            try:
                parsed = raw.parse()
                body_ = parsed.model_dump() if hasattr(parsed, "model_dump") else None
            except ValueError:
                body_ = None
            if not isinstance(body_, dict) or not body_.get("id"):  # another server on the port: a failed request
                return Reply(0, time.perf_counter() - t0, None,
                             f"{self.base_url}/v1/chat/completions answered {raw.status_code} with something that is "
                             f"not a chat completion: {raw.text[:200].strip()!r}")
            return Reply(raw.status_code, time.perf_counter() - t0, body_)
        except openai.APIStatusError as e:
            body_ = e.body if isinstance(e.body, dict) else None
            return Reply(e.status_code, time.perf_counter() - t0, body_, str(e)[:300])
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            return Reply(0, time.perf_counter() - t0, None, f"{type(e).__name__}: {e}"[:300])

    def feedback(self, body: dict[str, Any]) -> Reply:
        """``POST /v1/feedback`` with ``body``, under the API key."""
        t0 = time.perf_counter()
        try:
            r = self.http.post(self.base_url + "/v1/feedback", json=body,
                               headers={"Authorization": f"Bearer {self.api_key}"})
        except httpx.HTTPError as e:
            return Reply(0, time.perf_counter() - t0, None, f"{type(e).__name__}: {e}"[:300])
        try:
            data = r.json()
        except ValueError:
            data = None
        return Reply(r.status_code, time.perf_counter() - t0, data if isinstance(data, dict) else None,
                     None if r.is_success else r.text[:300])

    def reachable(self, key_source: str = "the API key given") -> Refusal | None:
        """None when the server answers ``GET /admin/status`` under the API key (so that feedback will
        be accepted too); else a :class:`Refusal`: no answer, or an error status, is the machine's
        (exit code 1, the URL named); a refused key is the input's (exit code 2, named by
        ``key_source``, where it was read from)."""
        url = self.base_url + "/admin/status"
        try:
            r = self.http.get(url, headers={"Authorization": f"Bearer {self.api_key}"})
        except httpx.HTTPError as e:
            return Refusal(f"cannot reach {url} ({type(e).__name__}: {e}): start selfrl serve first, or pass "
                           "--base-url with the address it serves on", 1)
        if r.status_code in (401, 403):
            return Refusal(f"{self.base_url} refuses the API key read from {key_source} ({r.status_code}): give "
                           "the key selfrl serve was started with (--api-key-file, else SELFRL_API_KEY)", 2)
        if r.is_success:
            try:
                if isinstance(r.json(), dict):
                    return None
            except ValueError:
                pass
            return Refusal(f"{url} answered {r.status_code} with something that is not selfrl serve's JSON "
                           f"({r.text[:200].strip() or 'no body'!r}): is selfrl serve running there? check --base-url",
                           1)
        return Refusal(f"{url} answered {r.status_code} ({r.text[:200].strip() or 'no body'}): is selfrl serve "
                       "running there? check --base-url", 1)

    def close(self) -> None:
        self.http.close()
