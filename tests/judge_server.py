"""A scripted judge: an OpenAI-compatible ``POST /v1/chat/completions`` on a free 127.0.0.1 port
(``http.server`` in a thread), answering each request with what its script says.

``script(body) -> Reply`` sees the request body (model, messages, response_format, ...);
helpers read what a judge would: :func:`candidates` (a group call's ``{id: text}``),
:func:`answer_text` (a pointwise call's answer) and :func:`task_text`. Every body is kept in
``requests``, so tests can count calls and check what was sent.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    """What the server answers: ``content`` as the message (status 200), or an error ``status``
    with ``content`` as its message; after ``delay_s`` seconds; with ``usage`` (None: omitted)."""

    content: str = ""
    status: int = 200
    delay_s: float = 0.0
    usage: tuple[int, int] | None = (100, 10)  # (prompt_tokens, completion_tokens)
    finish_reason: str = "stop"


def _block(text: str, label: str) -> str:
    m = re.search(rf"BEGIN {label}\n(.*?)\nEND {label}", text, re.DOTALL)
    return m.group(1) if m else ""


def user_text(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def candidates(body: dict) -> dict[str, str]:
    """A group call's ``{candidate id: rendered answer}``, in order."""
    text = user_text(body)
    return {cid: _block(text, f"CANDIDATE {cid}") for cid in re.findall(r"BEGIN CANDIDATE (c\d+)", text)}


def answer_text(body: dict) -> str:
    """A pointwise call's rendered answer."""
    return _block(user_text(body), "ANSWER")


def task_text(body: dict) -> str:
    return _block(user_text(body), "TASK")


def verdict_json(scores: dict[str, int] | int, explain: bool = True) -> str:
    """A group verdict for ``{id: score}`` or a pointwise one for a score (integers 0..10)."""
    def item(s: int) -> dict:
        return {"reason": "scripted", "score": s} if explain else {"score": s}

    if isinstance(scores, int):
        return json.dumps(item(scores))
    return json.dumps({cid: item(s) for cid, s in scores.items()})


def grade(score_of: Callable[[str, str], int], explain: bool = True) -> Callable[[dict], Reply]:
    """A script that scores each answer with ``score_of(task text, answer text)``, in either mode."""
    def script(body: dict) -> Reply:
        task = task_text(body)
        cands = candidates(body)
        if cands:
            return Reply(verdict_json({cid: score_of(task, a) for cid, a in cands.items()}, explain))
        return Reply(verdict_json(score_of(task, answer_text(body)), explain))
    return script


def solves(task: str, answer: str) -> int:
    """A competent arithmetic judge: 10 when the answer's <answer> number is the value of the
    task's expression (computed here), else 0."""
    expr = re.search(r"problem:\s*([-+*/() \d]+?)\s*=", task)
    got = re.search(r"<answer>\s*(-?\d+)\s*</answer>", answer)
    return 10 if expr and got and int(got.group(1)) == eval(expr.group(1)) else 0


class ScriptedJudge:
    """The server; a context manager. ``url`` is the base URL (``.../v1``)."""

    def __init__(self, script: Callable[[dict], Reply]):
        self.script, self.requests, self.lock = script, [], threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests.append({**body, "_authorization": self.headers.get("Authorization")})
                reply = owner.script(body)
                time.sleep(reply.delay_s)
                if reply.status != 200:
                    data = {"error": {"message": reply.content, "type": "invalid_request_error"}}
                else:
                    data = {"id": "x", "object": "chat.completion", "model": body.get("model"),
                            "choices": [{"index": 0, "finish_reason": reply.finish_reason,
                                         "message": {"role": "assistant", "content": reply.content}}]}
                    if reply.usage is not None:
                        data["usage"] = {"prompt_tokens": reply.usage[0], "completion_tokens": reply.usage[1],
                                         "total_tokens": sum(reply.usage)}
                raw = json.dumps(data).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a deadline)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
