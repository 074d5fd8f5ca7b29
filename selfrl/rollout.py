"""The agent loop: multi-turn rollouts with tool calls, batched across trajectories.

Each turn, every unfinished trajectory is extended by one assistant turn sampled
in one batched ``Engine.generate`` call. A turn whose text holds tool calls gets
them executed; their results are appended as tool messages (tokens with
``completion_mask`` 0) and the trajectory continues, up to ``max_turns``. A turn
without a tool call, a turn cut off at the token limit, or the last allowed turn
ends the trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from selfrl.chat import between_turns_ids, prompt_ids, template_supports_tools
from selfrl.engine import Engine
from selfrl.tasks import Task
from selfrl.toolcall import execute_call, format_tool_response, parse_tool_calls, render_tools_prompt
from selfrl.tools import Tool
from selfrl.trajectory import Trajectory

DEFAULT_SYSTEM_PROMPT = "You are a careful assistant. Give the final answer as <answer>NUMBER</answer>."

# One worked example shown before the task (few-shot). Measured on SmolLM2-135M with
# chain_sum: with no example the base model never called the tool (0/48 sampled);
# with this one it called it in about a third of samples; with two it always did
# and solved 100 % greedy, leaving RL nothing to learn. See README.
DEMONSTRATION: list[dict[str, str]] = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 38 - 5 + 14 ="},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "38 - 5 + 14"}}</tool_call>'},
    {"role": "tool", "content": "<tool_response>\n47\n</tool_response>"},
    {"role": "assistant", "content": "<answer>47</answer>"},
]


@dataclass
class RolloutConfig:
    """How the agent samples (one line of help per field)."""

    max_turns: int = 3  # assistant turns per trajectory (tool round-trips + final answer)
    max_new_tokens: int = 64  # token limit of one assistant turn
    temperature: float = 1.0  # sampling temperature (the learner uses the same value)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # instruction placed before the tool descriptions
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # registered tool names
    tools_prompt: str = "compact"  # how tool schemas are shown when the template can't: compact | json
    demonstration: bool = True  # show DEMONSTRATION (one worked tool call) before the task


def initial_messages(task: Task, tools: list[Tool], cfg: RolloutConfig, tokenizer) -> list[dict]:
    """System + user messages for a task; tool schemas go in the system text when the
    template cannot render them itself (SmolLM2)."""
    system = cfg.system_prompt
    if tools and not template_supports_tools(tokenizer):
        system = system + "\n\n" + render_tools_prompt(tools, cfg.tools_prompt)
    demo = [dict(m) for m in DEMONSTRATION] if cfg.demonstration and tools else []
    return [{"role": "system", "content": system}, *demo, {"role": "user", "content": task.question}]


def rollout(
    engine: Engine,
    tasks: list[Task],
    group_ids: list[str],
    tools: list[Tool],
    cfg: RolloutConfig,
    greedy: bool = False,
    on_turn: Callable[[], None] | None = None,
) -> list[Trajectory]:
    """Run one trajectory per ``(task, group_id)`` pair, batched.

    Args:
        engine: generates with the current adapter version.
        tasks: N tasks (repeat a task ``num_generations`` times for a GRPO group).
        group_ids: N group keys.
        tools: tools the agent may call.
        greedy: argmax decoding (validation) instead of sampling.
        on_turn: called after each batched turn (progress display).

    Returns:
        N trajectories with token ids, ``completion_mask``, sampling ``logprobs``,
        messages, tool calls, final answer and timings (seconds).
    """
    tok = engine.tokenizer
    native_tools = [t.openai_schema() for t in tools] if tools and template_supports_tools(tok) else None
    tool_map = {t.name: t for t in tools}
    # the template's end of turn is the tokenizer's EOS; the engine's ids are sorted, and the
    # lowest may be one the template never writes (Qwen2.5, Llama-3 list several).
    eos_text = tok.eos_token or tok.decode([engine.eos_token_ids[0]])
    trajs: list[Trajectory] = []
    for task, gid in zip(tasks, group_ids):
        msgs = initial_messages(task, tools, cfg, tok)
        ids = prompt_ids(tok, msgs, tools=native_tools)
        trajs.append(
            Trajectory(
                task_id=task.id, group_id=gid, adapter_version=engine.version, prompt_len=len(ids),
                token_ids=list(ids), completion_mask=[0] * len(ids), logprobs=[0.0] * len(ids),
                messages=msgs, timings={"generate": 0.0, "tools": 0.0},
            )
        )
    active = list(range(len(trajs)))
    for turn in range(cfg.max_turns):
        if not active:
            break
        t0 = time.perf_counter()
        gens = engine.generate(
            [trajs[i].token_ids for i in active], cfg.max_new_tokens, cfg.temperature, greedy=greedy
        )
        dt = (time.perf_counter() - t0) / len(active)
        still = []
        for i, g in zip(active, gens):
            tr = trajs[i]
            tr.timings["generate"] += dt
            tr.adapter_version = g.adapter_version
            tr.token_ids += g.token_ids
            tr.completion_mask += [1] * len(g.token_ids)
            tr.logprobs += g.logprobs
            tr.num_turns += 1
            text = tok.decode(g.token_ids, skip_special_tokens=True)
            tr.messages.append({"role": "assistant", "content": text})
            rest, calls = parse_tool_calls(text)
            if not g.finished:
                tr.truncated = True
                tr.final_answer = rest or None
                continue
            if not calls or turn == cfg.max_turns - 1:
                tr.final_answer = rest
                continue
            t1 = time.perf_counter()
            records = [execute_call(c, tool_map) for c in calls]  # never raises: errors go to the model
            tr.tool_calls += records
            contents = [format_tool_response(r) for r in records]
            tr.messages += [{"role": "tool", "content": c} for c in contents]
            try:
                extra = between_turns_ids(tok, contents, eos_text)
            except ValueError as e:
                # The chat template cannot continue after a tool message: the trajectory is
                # recorded as failed (left out of the update), the rest of the batch goes on.
                tr.error = f"rollout stopped after turn {turn + 1}: {e}"
                continue
            tr.token_ids += extra
            tr.completion_mask += [0] * len(extra)
            tr.logprobs += [0.0] * len(extra)
            tr.timings["tools"] += time.perf_counter() - t1
            still.append(i)
        active = still
        if on_turn is not None:
            on_turn()
    return trajs
