"""A family of users: one environment's tasks, tools and verifier, seen from the client side.

**Tasks the server never validates on.** A user's task is drawn with
``env.sample(1, seed)`` from a 62-bit seed of its plan (``selfrl.simulate.users``), far from
the small seeds runs use (``task.val_seed`` 2000, ``task.train_seed`` 1000). Generators repeat
questions across seeds, so the seed alone is not enough: the family rebuilds the server's
held-out set for its environment, as the gate builds it from ``heldout_seed`` and
``heldout_size`` (the server's ``task.val_seed`` and ``gate.val_size``; both
``selfrl.core.tasks.distinct_sample`` and the environment's own ``split`` are excluded), and a
drawn task whose id is in it is drawn again from the next seed (deterministic).

**Tools.** The environment's tools run here, on the client, as an OpenAI client runs its
functions: the registered tools the environment's config names (``rollout.tools``; the
calculator for arithmetic) plus the tools of its per-conversation state (``make_env``: the
web browser, the function-calling recorder). A call is executed by
``selfrl.chat.toolcall.execute_call`` (arguments checked against the schema first; a failure
is an error message to the model, never an exception). No environment used here runs
model-written code; one that needs the sandbox is refused.

**Verdict.** The environment's verifier on the conversation, as the rollout would score it:
``env.correct(task, env.trajectory_answer(trajectory))`` with the final text and the state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from selfrl.chat.toolcall import ParsedCall, execute_call, is_tool_error, parse_tool_calls
from selfrl.config import DEFAULT_SYSTEM_PROMPT, RolloutConfig
from selfrl.config.simulate import FamilySettings
from selfrl.core.tasks import Task, distinct_sample
from selfrl.core.tools import Tool, ToolError, evaluate_expression, resolve_tools
from selfrl.core.trajectory import ToolCallRecord, Trajectory
from selfrl.envs.registry import build_env

SANDBOXED = ("code", "swe")  # environments whose tools run model-written code: not for a client
MAX_REDRAWS = 1000  # seeds tried before a family gives up finding a task outside the held-out set
_DEMO_CALCULATOR = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 38 - 5 + 14 ="},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "38 - 5 + 14"}}</tool_call>'},
    {"role": "tool", "content": "<tool_response>\n47\n</tool_response>"},
    {"role": "assistant", "content": "<answer>47</answer>"},
]  # selfrl.rollout.agent.DEMONSTRATION, the calculator's worked example (copied: rollout loads the engines)


def held_out_ids(env, size: int, seed: int) -> set[str]:
    """Task ids of the server's held-out set of ``env`` (``size`` tasks from ``seed``), whichever way
    the gate builds it: ``distinct_sample`` (the serving gate) or the environment's ``split``."""
    if size == 0:
        return set()
    ids = {t.id for t in distinct_sample(env, size, seed)}
    try:
        ids |= {t.id for t in env.split(0, size, 0, seed)[1]}
    except ValueError:  # a split the environment cannot make at this size: distinct_sample stands
        pass
    return ids


def openai_messages(chat: list[dict[str, str]], prefix: str) -> list[dict[str, Any]]:
    """A worked example in selfrl's chat form (``<tool_call>`` text, ``<tool_response>`` tool turns)
    as OpenAI messages: assistant ``tool_calls`` with ids ``<prefix>-<i>``, tool messages answering them."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for m in chat:
        if m["role"] == "assistant":
            text, calls = parse_tool_calls(m["content"])
            ids = [f"{prefix}-{len(out)}-{i}" for i in range(len(calls))]
            msg: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                msg["tool_calls"] = [{"id": i, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in zip(ids, calls)]
            elif not text:
                msg["content"] = ""
            out.append(msg)
            pending = ids
        elif m["role"] == "tool":
            body = m["content"].removeprefix("<tool_response>").removesuffix("</tool_response>").strip()
            out.append({"role": "tool", "tool_call_id": pending.pop(0) if pending else f"{prefix}-x", "content": body})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass
class Episode:
    """One conversation's environment: the task, its state (or None), its tools, the calls made."""

    task: Task
    state: Any
    tools: dict[str, Tool]
    records: list[ToolCallRecord] = field(default_factory=list)

    def call(self, name: str, arguments: str) -> str:
        """Run the model's call ``name(arguments)`` (a JSON string); returns the tool message's text."""
        try:
            args = json.loads(arguments or "{}")
            parsed = ParsedCall(name, args, arguments) if isinstance(args, dict) else \
                ParsedCall(name, {}, arguments, "arguments must be a JSON object")
        except ValueError as e:
            parsed = ParsedCall(name, {}, arguments, f"arguments are not JSON: {e}")
        record = execute_call(parsed, self.tools)
        self.records.append(record)
        return record.result

    def done(self) -> bool:
        """The environment says the episode is over (a state's ``is_completed``)."""
        return self.state is not None and bool(self.state.is_completed())

    def close(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(the state's final summary, None)``, or ``(None, error)`` when the state's ``state()`` or
        ``close()`` raised (the conversation is then logged with that error and not judged);
        ``(None, None)`` without a state."""
        if self.state is None:
            return None, None
        try:
            summary = self.state.state()
            close = getattr(self.state, "close", None)
            if callable(close):
                close()
        except Exception as e:
            return None, f"environment failed: {type(e).__name__}: {e}"[:300]
        return summary, None


def build_families(cfg) -> dict[str, "Family"]:
    """``{name: Family}`` of every ``[[families]]`` table of ``cfg`` (a :class:`SimulateConfig`):
    ``selfrl simulate`` builds them before it contacts the server, so a family that cannot run is
    refused before any request.

    Raises:
        ValueError: a family cannot be built (:class:`Family`); the message starts with
            ``families[i] (<name>)``.
    """
    out = {}
    for i, s in enumerate(cfg.families):
        try:
            out[s.name] = Family(s)
        except ValueError as e:
            raise ValueError(f"families[{i}] ({s.name}).{e}") from e
    return out


class Family:
    """One family's environment, held-out set and settings (see the module docstring).

    Raises:
        ValueError: an unknown environment (the valid names listed), bad options, one that runs
            model-written code, ``tool_choice = "required"`` with an environment that offers no
            tools, or a ``heldout_size`` above the distinct tasks the environment has. The message
            starts with the setting at fault (``env: ...``, ``tool_choice: ...``, ``heldout_size: ...``).
    """

    def __init__(self, s: FamilySettings):
        if s.env in SANDBOXED:
            raise ValueError(f"env: environment {s.env!r} runs model-written code, which a simulated client "
                             "must not run; use arithmetic, function_calling, web or webshop")
        self.settings = s
        self.name = s.name
        try:
            self.env = build_env(s.env, s.options, f"[[families]] {s.name!r}")
        except ValueError as e:
            raise ValueError(f"env: {e}") from e
        defaults = getattr(self.env, "config_defaults", {}) or {}
        self.system_prompt = defaults.get("rollout.system_prompt", DEFAULT_SYSTEM_PROMPT)
        self.shared_tools = resolve_tools(defaults.get("rollout.tools", RolloutConfig().tools))
        try:
            self.held_out = held_out_ids(self.env, s.heldout_size, s.heldout_seed)
        except ValueError as e:
            raise ValueError(f"heldout_size: {e}; lower heldout_size, and the server's val_size for this "
                             "family with it") from e
        if s.tool_choice == "required" and not self.offers_tools():
            raise ValueError(f"tool_choice: \"required\" asks every completion for a tool call, but environment "
                             f"{s.env!r} offers no tools; set tool_choice = \"auto\" (or \"none\") for this family")

    def offers_tools(self) -> bool:
        """The first turn of a conversation offers tools: shared ones, or its state's (one task opened to see)."""
        if self.shared_tools:
            return True
        ep = self.open(self.task(0))
        try:
            return bool(self.openai_tools(ep))
        finally:
            ep.close()

    def task(self, seed: int) -> Task:
        """The task of ``seed``: the environment's draw, or of the next seeds while it is held out.

        Raises:
            ValueError: ``MAX_REDRAWS`` seeds in a row gave held-out tasks.
        """
        for k in range(MAX_REDRAWS):
            [task] = self.env.sample(1, (seed + k) % 2**62)
            if task.id not in self.held_out:
                return task
        raise ValueError(f"family {self.name!r}: {MAX_REDRAWS} draws gave only held-out tasks; lower heldout_size")

    def open(self, task: Task) -> Episode:
        """The task's environment state and tools (shared tools first, then the state's)."""
        state = self.env.make_env(task)
        tools = {t.name: t for t in [*self.shared_tools, *(getattr(state, "tools", None) or [])]}
        return Episode(task, state, tools)

    def first_messages(self, ep: Episode, prefix: str) -> list[dict[str, Any]]:
        """System prompt, the worked example (``demonstration``), then the task, as OpenAI messages."""
        demo = getattr(ep.state, "demonstration", None) if ep.state is not None else None
        example = openai_messages(demo if demo is not None else _DEMO_CALCULATOR, prefix) \
            if self.settings.demonstration and ep.tools else []
        return [{"role": "system", "content": self.system_prompt}, *example, {"role": "user", "content": ep.task.question}]

    def openai_tools(self, ep: Episode) -> list[dict[str, Any]]:
        """The tools offered this turn, as OpenAI tool definitions: the shared tools, then the
        state's, narrowed to its current state where it says so (``turn_tools()``: the web's
        ``page_ids`` offers only the ids of the page shown, as ``selfrl run``'s per-turn grammar
        does; with ``tool_choice = "required"`` the server decodes under exactly these schemas).
        Calls still go to the episode's full tools, which check everything again."""
        narrow = getattr(ep.state, "turn_tools", None) if ep.state is not None else None
        turn = narrow() if callable(narrow) else None
        if turn is None:
            return [t.openai_schema() for t in ep.tools.values()]
        return [t.openai_schema() for t in [*self.shared_tools, *turn]]

    def right_calls(self, task: Task, messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The calls a user who knows the answer corrects a turn with (``[{"name", "arguments": {...}}]``),
        or [] when the turn's right answer is text.

        * A function-calling task: its first possible answer.
        * A task whose item has an ``expression`` that the calculator evaluates to the task's
          answer (arithmetic; not countdown, whose answer is the expression itself), where the
          family's users offer the calculator (not ``tool_choice = "none"``) and no tool has
          answered since the user's question (in ``messages``, the conversation through the
          corrected turn; an error or an empty result is no answer): the calculator on that
          expression, as the worked example calls it. After the calculator's result the right
          answer is the number, as text.
        """
        if "ground_truth" in task.metadata:
            from selfrl.envs.function_calling import first_answer_calls

            return first_answer_calls(task)
        entry = task.metadata.get("entry")
        expression = ((entry.get("metadata") or {}) if isinstance(entry, dict) else {}).get("expression")
        offered = self.settings.tool_choice != "none" and "calculator" in {t.name for t in self.shared_tools}
        if not isinstance(expression, str) or not offered or not _evaluates_to(expression, task.answer):
            return []
        since = list(messages or [])
        last_user = max((i for i, m in enumerate(since) if m.get("role") == "user"), default=-1)
        if any(m.get("role") == "tool" and (c := str(m.get("content") or "").strip()) and not is_tool_error(c)
               for m in since[last_user + 1:]):
            return []
        return [{"name": "calculator", "arguments": {"expression": expression}}]

    def correct(self, ep: Episode, final_text: str, state: dict[str, Any] | None) -> bool:
        """The verifier's verdict on the conversation (``final_text``: the last answer's text)."""
        traj = Trajectory(ep.task.id, "simulate", 0, messages=[{"role": "assistant", "content": final_text}],
                          tool_calls=list(ep.records), final_answer=final_text, env_state=state)
        return bool(self.env.correct(ep.task, self.env.trajectory_answer(traj)))


def _evaluates_to(expression: str, answer: str) -> bool:
    """Whether the calculator evaluates ``expression`` to the number ``answer``."""
    try:
        return abs(float(evaluate_expression(expression)) - float(answer)) < 1e-9
    except (ToolError, ValueError, TypeError):  # TypeError: a task whose answer is None
        return False
