"""One judge endpoint over HTTP: an OpenAI-compatible ``/chat/completions`` call with a
deadline, retries, a concurrency limit and token accounting.

The answer is asked for through structured output (``response_format`` with a JSON schema,
which ``selfrl serve`` enforces by grammar and vLLM and OpenAI support); an endpoint that
refuses ``response_format`` with a 400 or 422 is asked again without it, from then on, and
its text is parsed strictly (:mod:`selfrl.judge.verdict`). A timeout, a connection error, a
429 or 5xx answer, or an unreadable verdict is tried again up to ``retries`` times, with a
short backoff; any other 4xx fails at once (the message is the endpoint's reason). Tokens
of every try count, failed ones included: they are paid for too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from selfrl.config.judge import JudgeEndpoint
from selfrl.engines.http import RemoteBackendError, RemoteRequestError, call
from selfrl.judge.verdict import JudgeFailure

T = TypeVar("T")
BACKOFF_S = 0.25  # first pause between tries; doubled each try, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 4.0


@dataclass
class Tally:
    """Counters of one endpoint since the last :meth:`JudgeClient.pop_tally` (tokens as the
    endpoint's ``usage`` reports them; a call without ``usage`` counts in ``unmetered``)."""

    calls: int = 0  # calls made (each with its tries)
    tries: int = 0  # HTTP requests sent
    timeouts: int = 0  # tries that ran past the deadline
    failed_calls: int = 0  # calls with no usable verdict after every try
    input_tokens: int = 0
    output_tokens: int = 0
    unmetered: int = 0  # answers without a usage block (their tokens are unknown, their cost uncounted)
    seconds: float = 0.0  # wall time of the calls, summed


class JudgeClient:
    """Calls one :class:`selfrl.config.judge.JudgeEndpoint`; thread-safe (calls run in a pool).

    Args:
        endpoint: where and how to call.
        api_key: the key sent as ``Authorization: Bearer``; None reads ``endpoint.api_key_env``
            from the environment (no variable named: no key).

    Raises:
        ValueError: ``api_key_env`` names a variable that is not set.
    """

    def __init__(self, endpoint: JudgeEndpoint, api_key: str | None = None):
        self.endpoint = endpoint
        if api_key is None and endpoint.api_key_env:
            api_key = os.environ.get(endpoint.api_key_env)
            if not api_key:
                raise ValueError(f"judge {endpoint.name}: the environment variable {endpoint.api_key_env} "
                                 "(api_key_env) is not set; export the judge's API key in it")
        self.api_key = api_key
        self.structured = endpoint.structured_output == "json_schema"
        self.slots = threading.BoundedSemaphore(endpoint.max_concurrency)
        self.lock = threading.Lock()
        self.tally = Tally()

    def pop_tally(self) -> Tally:
        """The counters since the last call, then zeroed."""
        with self.lock:
            out, self.tally = self.tally, Tally()
        return out

    def _count(self, **add: float) -> None:
        with self.lock:
            for k, v in add.items():
                setattr(self.tally, k, getattr(self.tally, k) + v)

    def body(self, messages: list[dict[str, Any]], schema: dict[str, Any]) -> dict[str, Any]:
        """The request body: model, messages, temperature, max_tokens, and (structured) ``response_format``."""
        e = self.endpoint
        body: dict[str, Any] = {"model": e.model, "messages": messages, "temperature": e.temperature,
                                "max_tokens": e.max_tokens}
        if self.structured:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
        return body

    def complete(self, messages: list[dict[str, Any]], schema: dict[str, Any], parse: Callable[[str], T]) -> T:
        """Ask for a verdict and read it with ``parse(text)``, trying up to ``1 + retries`` times.

        Raises:
            JudgeFailure: every try failed (the last reason is in the message), or the endpoint
                refused the request with a 4xx other than 408 and 429.
        """
        e, last = self.endpoint, "no try made"
        t0 = time.perf_counter()
        self._count(calls=1)
        try:
            for attempt in range(e.retries + 1):
                if attempt:
                    time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
                try:
                    text, finish = self._send(messages, schema)
                    try:
                        return parse(text)
                    except JudgeFailure as err:
                        if finish == "length":  # say what to change
                            raise JudgeFailure(f"{err} (the answer was cut at max_tokens = {e.max_tokens}; raise "
                                               "max_tokens, or set explain = false)") from None
                        raise
                except TimeoutError:
                    self._count(timeouts=1)
                    last = f"no answer within deadline_s = {e.deadline_s:g} s"
                except RemoteBackendError as err:
                    last = str(err)
                except RemoteRequestError as err:
                    if err.status not in (408, 429):
                        raise JudgeFailure(f"judge {e.name}: {e.base_url} refused the request (HTTP {err.status}): "
                                           f"{err}") from None
                    last = f"HTTP {err.status}: {err}"
                except JudgeFailure as err:
                    last = str(err)
            self._count(failed_calls=1)
            raise JudgeFailure(f"judge {e.name}: no usable verdict after {e.retries + 1} tries; last: {last}")
        finally:
            self._count(seconds=time.perf_counter() - t0)

    def _send(self, messages: list[dict[str, Any]], schema: dict[str, Any]) -> tuple[str, str | None]:
        """One request (waiting for a slot first); returns the answer's text and its
        ``finish_reason``, and counts its tokens.
        A 400 or 422 to a structured request turns structured output off and asks again once."""
        e = self.endpoint
        with self.slots:
            self._count(tries=1)
            body = self.body(messages, schema)
            try:
                answer = call(e.base_url, "/chat/completions", body, timeout_s=e.deadline_s, api_key=self.api_key)
            except RemoteRequestError as err:
                if not ("response_format" in body and err.status in (400, 422)):
                    raise
                self.structured = False  # the endpoint has no structured output: strict parsing from now on
                self._count(tries=1)
                answer = call(e.base_url, "/chat/completions", self.body(messages, schema), timeout_s=e.deadline_s,
                              api_key=self.api_key)
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self._count(input_tokens=usage["prompt_tokens"], output_tokens=int(usage.get("completion_tokens") or 0))
        else:
            self._count(unmetered=1)
        try:
            choice = answer["choices"][0]
            return choice["message"]["content"] or "", choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise JudgeFailure(f"unreadable answer (no choices[0].message.content): {str(answer)[:200]!r}") from None


def tally_sum(tallies: list[Tally]) -> Tally:
    """Field-wise sum of ``tallies``."""
    out = Tally()
    for t in tallies:
        for f in fields(Tally):
            setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
    return out
