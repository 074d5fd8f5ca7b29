"""Test helpers for the user simulator (``tests/test_simulate*.py``): a scripted stand-in for
``selfrl serve`` and the one-family arithmetic config, without a model."""

from __future__ import annotations

import itertools
import json

from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig
from selfrl.simulate.client import Reply
from selfrl.simulate.families import Family


class ScriptedServer:
    """A stand-in for ``selfrl serve``: answers arithmetic with a calculator call, then the tool's
    result (right unless ``wrong``), anything else with plain text; feedback is 200 for a served
    response and a rating in [-1, 1], 400 out of range, 404 for an unknown id. Records the clock's
    time of every request."""

    def __init__(self, clock=None, wrong: bool = False):
        self.clock, self.wrong = clock, wrong
        self.ids = itertools.count()
        self.served: set[str] = set()
        self.calls: list[tuple[str, float, dict]] = []

    def chat(self, user, body):
        self.calls.append(("chat", self.clock() if self.clock else 0.0, body))
        rid = f"chatcmpl-{next(self.ids)}"
        self.served.add(rid)
        msgs = body["messages"]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        tool = next((m for m in msgs[last_user + 1:] if m["role"] == "tool"), None)
        names = [t["function"]["name"] for t in body.get("tools", [])]
        message = {"role": "assistant", "content": "I cannot tell."}
        if tool is not None:
            value = int(tool["content"]) + (1 if self.wrong else 0)
            message = {"role": "assistant", "content": f"<answer>{value}</answer>"}
        elif "calculator" in names and "problem:" in msgs[last_user]["content"]:
            expr = msgs[last_user]["content"].split("problem:")[1].split("=")[0].strip()
            message = {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{rid}", "type": "function",
                       "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}]}
        return Reply(200, 0.01, {"id": rid, "choices": [{"index": 0, "message": message}]})

    def feedback(self, body):
        self.calls.append(("feedback", self.clock() if self.clock else 0.0, body))
        if body["response_id"] not in self.served:
            return Reply(404, 0.001, {"error": {"message": "no such response"}}, "404")
        r = body.get("rating")
        if r is not None and not -1 <= r <= 1:
            return Reply(400, 0.001, {"error": {"message": "rating out of range"}}, "400")
        return Reply(200, 0.001, {"object": "feedback"})


def arithmetic_config(**top) -> SimulateConfig:
    cfg = SimulateConfig(families=[FamilySettings("arithmetic", "chain_sum", users=50)],
                         phases=[PhaseSettings(86400.0, {"arithmetic": 1.0})], arrivals_per_hour=4.0,
                         max_requests=10_000)
    for k, v in top.items():
        setattr(cfg, k, v)
    return cfg.validate()


def arithmetic_family() -> Family:
    """The ``chain_sum`` family with its default settings (the tests' module-scoped ``arithmetic``)."""
    return Family(FamilySettings("arithmetic", "chain_sum"))
