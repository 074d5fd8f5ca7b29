"""The agent loop: multi-turn rollouts with tool calls, batched across trajectories.

Each turn, every unfinished trajectory is extended by one assistant turn sampled
in one batched ``Engine.generate`` call. A turn whose text holds tool calls gets
them executed; their results are appended as tool messages (tokens with
``completion_mask`` 0) and the trajectory continues, up to ``max_turns``. A turn
without a tool call, a turn cut off at the token limit, or the last allowed turn
ends the trajectory.

Stateful tools (a web shop's cart) come from an ``Environment`` made per
trajectory by ``env_factory(task)`` (see ``selfrl.envs``): its tools are added to
the shared ones for that trajectory only, its demonstration replaces the
calculator's, the episode ends early when ``is_completed()`` says so, and its
final ``state()`` is recorded as ``Trajectory.env_state`` (then its optional
``close()`` is called: ``close_env``). Without an
``env_factory`` nothing changes. ``scripted_rollout`` runs the same tool
handling with a scripted policy instead of a model (tests, demonstrations).

A task may carry its own rollout settings (an agent's or family's: :mod:`selfrl.rollout.overrides`);
its trajectory runs under them, so one batch may mix constrained and free rows.

A failing environment fails only its own trajectory: when ``env_factory(task)`` (the
reset), ``is_completed()``, ``turn_tools()``, ``state()`` or ``close()`` raises, the
exception is recorded as that trajectory's ``error`` (it is left out of the update, as a
failed reward is: ``selfrl.envs.rewards.score_group``), the trajectory ends there, and the other
rows of the batch go on. A tool that raises is an error message to the model
(``selfrl.chat.toolcall.execute_call``). Every environment made is closed exactly once.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from selfrl.chat.template import (
    between_turns_ids,
    decode_turn,
    prompt_ids,
    template_supports_tools,
    template_wraps_tool_responses,
)
from selfrl.config import DEFAULT_SYSTEM_PROMPT, RolloutConfig
from selfrl.engines.base import Generation, SamplingEngine, engine_context
from selfrl.core.tasks import EnvState as Environment
from selfrl.core.tasks import Task
from selfrl.chat.toolcall import (
    TOOL_CALL_CLOSE,
    ParsedCall,
    execute_call,
    format_tool_response,
    parse_tool_calls,
    render_tools_prompt,
)
from selfrl.core.tools import Tool, resolve_tools
from selfrl.core.trajectory import Trajectory
from selfrl.rollout.overrides import task_overrides, task_rollout_config

EnvFactory = Callable[[Task], "Environment | None"]
ScriptedPolicy = Callable[[Task, list[dict]], str]  # (task, messages so far) -> next assistant text


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


def initial_messages(
    task: Task, tools: list[Tool], cfg: RolloutConfig, tokenizer, demonstration: list[dict] | None = None
) -> list[dict]:
    """System + user messages for a task; tool schemas go in the system text when the
    template cannot render them itself (SmolLM2). ``demonstration`` replaces
    ``DEMONSTRATION`` (an environment's own worked example)."""
    system = cfg.system_prompt
    if tools and not template_supports_tools(tokenizer):
        system = system + "\n\n" + render_tools_prompt(tools, cfg.tools_prompt)
    example = DEMONSTRATION if demonstration is None else demonstration
    demo = [dict(m) for m in example] if cfg.demonstration and tools else []
    return [{"role": "system", "content": system}, *demo, {"role": "user", "content": task.question}]


def rollout(
    engine: SamplingEngine,
    tasks: list[Task],
    group_ids: list[str],
    tools: list[Tool],
    cfg: RolloutConfig,
    greedy: bool = False,
    on_turn: Callable[[], None] | None = None,
    env_factory: EnvFactory | None = None,
) -> list[Trajectory]:
    """Run one trajectory per ``(task, group_id)`` pair, batched.

    Args:
        engine: generates with the current adapter version.
        tasks: N tasks (repeat a task ``num_generations`` times for a GRPO group).
        group_ids: N group keys.
        tools: tools the agent may call.
        greedy: argmax decoding (validation) instead of sampling.
        on_turn: called after each batched turn (progress display).
        env_factory: ``task -> Environment | None``, one per trajectory (stateful tools).

    Returns:
        N trajectories with token ids, ``completion_mask``, sampling ``logprobs``,
        messages, tool calls, final answer, timings (seconds) and, with an
        environment, its final ``env_state``.

    Raises:
        Whatever the engine (a failed generation) or ``on_turn`` raised; the rollout's
        environments are closed first, and on the pipelined path its rows still decoding are
        cancelled (nothing runs on for a rollout that failed). An environment that raises
        fails only its own trajectory (see the module docstring).
    """
    tok = engine.tokenizer
    cfgs = [task_rollout_config(cfg, task) for task in tasks]
    row_tools = [resolve_tools(own["tools"]) if "tools" in own else tools for own in map(task_overrides, tasks)]
    for c, task in zip(cfgs, tasks):
        if c.constrain != "none" and not getattr(engine, "supports_constraints", False):
            whose = f"task {task.id}'s own rollout" if "constrain" in task_overrides(task) else "rollout"
            raise ValueError(f"{whose}.constrain = {c.constrain!r} needs an engine with grammar constraints; "
                             f"{type(engine).__name__} has none (use the reference or slots engine)")
    made = [make_env(env_factory, task) for task in tasks]
    envs = [env for env, _ in made]
    tool_maps = []
    # the template's end of turn is the tokenizer's EOS; the engine's ids are sorted, and the
    # lowest may be one the template never writes (Qwen2.5, Llama-3 list several).
    eos_text = tok.eos_token or tok.decode([engine.eos_token_ids[0]])
    eos_id = tok.eos_token_id if tok.eos_token else engine.eos_token_ids[0]
    trajs: list[Trajectory] = []
    constraints: list = []
    for i, (task, gid) in enumerate(zip(tasks, group_ids)):
        error, cfg_i, shared = made[i][1], cfgs[i], row_tools[i]
        try:  # the environment's tools, worked example and first grammar: its own failure, if any
            env_tools = envs[i].tools if envs[i] is not None else []
            demonstration = envs[i].demonstration if envs[i] is not None else None
            offered = offered_tools(shared, envs[i])
        except Exception as e:
            error = env_failure("setup (tools, demonstration, turn_tools())", e)
            env_tools, demonstration, offered = [], None, shared
        t_tools = shared + env_tools
        tool_maps.append({t.name: t for t in t_tools})
        if cfg_i.constrain != "none" and not t_tools and error is None:
            raise ValueError(f"rollout.constrain = {cfg_i.constrain!r} needs tools to call, and task {task.id} "
                             "has none (set rollout.tools, or constrain = \"none\")")
        constraints.append(turn_constraint(cfg_i, offered))
        native_tools = [t.openai_schema() for t in t_tools] if t_tools and template_supports_tools(tok) else None
        msgs = initial_messages(task, t_tools, cfg_i, tok, demonstration)
        ids = prompt_ids(tok, msgs, tools=native_tools)
        trajs.append(
            Trajectory(
                task_id=task.id, group_id=gid, adapter_version=engine.version, prompt_len=len(ids),
                token_ids=list(ids), completion_mask=[0] * len(ids), logprobs=[0.0] * len(ids),
                messages=msgs, timings={"generate": 0.0, "tools": 0.0}, error=error,
            )
        )
    turn_ctx = _TurnContext(tok, cfg, eos_id, eos_text, constraints, row_tools, engine_context(engine),
                            cfgs)
    try:
        if callable(getattr(engine, "submit", None)):
            _pipelined_turns(engine, trajs, tool_maps, envs, turn_ctx, greedy, on_turn)
        else:
            _batched_turns(engine, trajs, tool_maps, envs, turn_ctx, greedy, on_turn)
    except BaseException as e:  # nothing of the failed rollout is kept: release what its environments hold
        for env in envs:
            if env is not None:
                try:
                    close_env(env)
                except Exception as c:
                    e.add_note(f"closing an environment after that failed too: {type(c).__name__}: {c}")
        raise
    for tr, env in zip(trajs, envs):
        finish_env(tr, env)
    return trajs


def env_failure(hook: str, e: BaseException) -> str:
    """The ``Trajectory.error`` of an environment hook that raised ``e``."""
    return f"environment {hook} failed: {type(e).__name__}: {e}"


def make_env(env_factory: EnvFactory | None, task: Task) -> tuple[Environment | None, str | None]:
    """``(env_factory(task), None)``, or ``(None, error)`` when it raised (the reset failed:
    the trajectory is recorded with that error and never sampled)."""
    if env_factory is None:
        return None, None
    try:
        return env_factory(task), None
    except Exception as e:
        return None, env_failure("reset (make_env)", e)


def finish_env(tr: Trajectory, env: Environment | None) -> None:
    """Record ``env``'s final ``state()`` on ``tr`` (unless ``tr`` already failed) and close it,
    once; a hook that raises becomes ``tr.error`` (the first failure is kept)."""
    if env is None:
        return
    if tr.error is None:
        try:
            tr.env_state = env.state()
        except Exception as e:
            tr.error = env_failure("state()", e)
    try:
        close_env(env)
    except Exception as e:
        tr.error = tr.error or env_failure("close()", e)


def env_offers_tools(env_factory: EnvFactory, task: Task) -> bool:
    """Whether the environment made for ``task`` has tools of its own (the loop's diagnosis of
    a run without signal); the environment is closed again, and one that fails says False."""
    env, _ = make_env(env_factory, task)
    if env is None:
        return False
    try:
        return bool(getattr(env, "tools", None))
    except Exception:
        return False
    finally:
        try:
            close_env(env)
        except Exception:  # noqa: S110 (a diagnosis only; the rollouts record their own close() failures)
            pass


def close_env(env: Environment) -> None:
    """Release what an environment holds once its state is recorded (a real browser's page:
    ``selfrl.envs.web_browser``), through its optional ``close()``."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


@dataclass
class _TurnContext:
    """What every turn of a rollout needs besides its own trajectory."""

    tok: object
    cfg: RolloutConfig  # the batch's: token limit and temperature of every engine call
    eos_id: int
    eos_text: str
    constraints: list  # per trajectory: the grammar of each of its turns, or None
    tools: list  # per trajectory: the tools it has besides its environment's
    context: int | None = None  # tokens the engine attends to (prompt + completion); None: unknown
    cfgs: list | None = None  # per trajectory: its RolloutConfig (task_rollout_config); None: cfg for all

    def row(self, i: int) -> RolloutConfig:
        """Trajectory ``i``'s settings (its turn limit, stop, grammar kind)."""
        return self.cfg if self.cfgs is None else self.cfgs[i]

    def stop(self, i: int) -> list[str] | None:
        """The stop strings of trajectory ``i``'s turns: ``</tool_call>`` with ``stop_at_tool_call``."""
        return [TOOL_CALL_CLOSE] if self.row(i).stop_at_tool_call else None


def _fits(tr: Trajectory, turn: int, ctx: _TurnContext) -> bool:
    """Whether turn ``turn`` of ``tr`` (its tokens so far plus ``max_new_tokens``) fits in the
    engine's context. When it does not, the trajectory ends here, before the engine is asked
    (a remote sampler refuses such a request with a 400; a local model would attend past the
    positions it was trained on): truncated, and with nothing sampled yet (the first turn) also
    failed (``error`` set, so it is left out of the update)."""
    if ctx.context is None or len(tr.token_ids) + ctx.cfg.max_new_tokens <= ctx.context:
        return True
    tr.truncated = True
    if turn == 0:
        tr.error = (f"the prompt is {len(tr.token_ids)} tokens; with rollout.max_new_tokens = "
                    f"{ctx.cfg.max_new_tokens} it exceeds the model's context of {ctx.context} tokens")
    elif 1 in tr.completion_mask:  # drop the tool replies and next header appended after the last sampled turn:
        end = len(tr.completion_mask) - tr.completion_mask[::-1].index(1)  # the stored ids must fit the context
        del tr.token_ids[end:], tr.completion_mask[end:], tr.logprobs[end:]
    return False


def _after_turn(tr: Trajectory, g: Generation, turn: int, tool_map: dict[str, Tool], env: Environment | None,
                ctx: _TurnContext, constraint=None, cfg: RolloutConfig | None = None) -> bool:
    """Append the sampled turn ``g`` to ``tr`` (``constraint``: the grammar it was sampled
    under, recorded in ``tr.constraints``; ``cfg``: the trajectory's settings, else ``ctx.cfg``)
    and run its tool calls; True when the trajectory goes on to another turn (its tool results
    and the next turn's header are appended then)."""
    tok, cfg = ctx.tok, cfg or ctx.cfg
    tr.adapter_version = g.adapter_version
    if constraint is not None:
        start = len(tr.token_ids)
        tr.constraints.append({"start": start, "end": start + len(g.token_ids), "kind": constraint.kind,
                               "grammar": constraint.grammar})
    tr.token_ids += g.token_ids
    tr.completion_mask += [1] * len(g.token_ids)
    tr.logprobs += g.logprobs
    tr.num_turns += 1
    text = decode_turn(tok, g.token_ids)  # a <tool_call> the tokenizer marks special is kept
    tr.messages.append({"role": "assistant", "content": text})
    rest, calls = parse_tool_calls(text)
    if g.grammar_error is not None:  # the turn's grammar failed mid-generation: the trajectory ends, failed
        tr.error = f"turn {turn + 1}: the grammar failed: {g.grammar_error}"
        tr.truncated = True
        return False
    if not g.finished:
        tr.truncated = True
        tr.final_answer = rest or None
        return False
    if not calls or turn == cfg.max_turns - 1:
        tr.final_answer = rest
        return False
    t1 = time.perf_counter()
    contents = run_tool_calls(tr, calls, tool_map, wrap=not template_wraps_tool_responses(tok))
    try:
        completed = env is not None and env.is_completed()
    except Exception as e:  # this trajectory ends, failed; the batch goes on
        tr.error = env_failure(f"is_completed() after turn {turn + 1}", e)
        completed = True
    if completed:
        tr.final_answer = rest
        tr.timings["tools"] += time.perf_counter() - t1
        return False
    try:
        # a turn cut at "</tool_call>" sampled no EOS: the end of turn is added (mask 0)
        extra = ([ctx.eos_id] if g.stopped else []) + between_turns_ids(tok, contents, ctx.eos_text)
    except ValueError as e:
        # The chat template cannot continue after a tool message: the trajectory is
        # recorded as failed (left out of the update), the rest of the batch goes on.
        tr.error = f"rollout stopped after turn {turn + 1}: {e}"
        return False
    tr.token_ids += extra
    tr.completion_mask += [0] * len(extra)
    tr.logprobs += [0.0] * len(extra)
    tr.timings["tools"] += time.perf_counter() - t1
    return True


def _batched_turns(engine: SamplingEngine, trajs: list[Trajectory], tool_maps, envs, ctx: _TurnContext,
                   greedy: bool, on_turn: Callable[[], None] | None) -> None:
    """Turn by turn: one ``generate`` call per turn over every unfinished trajectory (one per
    stop setting, when the rows' own settings differ in it)."""
    cfg = ctx.cfg
    active = [i for i, tr in enumerate(trajs) if tr.error is None]  # a failed reset is never sampled
    for turn in range(max(ctx.row(i).max_turns for i in range(len(trajs))) if trajs else 0):
        active = [i for i in active if _fits(trajs[i], turn, ctx)]
        if not active:
            break
        still = []
        for stop in (None, [TOOL_CALL_CLOSE]):
            rows = [i for i in active if ctx.stop(i) == stop]
            if not rows:
                continue
            t0 = time.perf_counter()
            extra = {"stop": stop} if stop else {}
            if any(ctx.constraints[i] is not None for i in rows):
                extra["constraints"] = [ctx.constraints[i] for i in rows]
            gens = engine.generate([trajs[i].token_ids for i in rows], cfg.max_new_tokens, cfg.temperature,
                                   greedy=greedy, **extra)
            dt = (time.perf_counter() - t0) / len(rows)
            for i, g in zip(rows, gens):
                trajs[i].timings["generate"] += dt
                if _after_turn(trajs[i], g, turn, tool_maps[i], envs[i], ctx, ctx.constraints[i], ctx.row(i)) and \
                        _next_constraint(ctx, i, envs[i], trajs[i]):
                    still.append(i)
        active = sorted(still)
        if on_turn is not None:
            on_turn()


def _pipelined_turns(engine, trajs: list[Trajectory], tool_maps, envs, ctx: _TurnContext, greedy: bool,
                     on_turn: Callable[[], None] | None) -> None:
    """Each trajectory on its own: its next turn is submitted as soon as its tools have
    answered, so it joins the engine's running batch and nobody waits for the slowest
    row of a turn (engines with ``submit``, e.g. :class:`selfrl.engines.slots.SlotEngine`).
    ``on_turn`` is called once per turn index reached, when no trajectory is left at that turn
    or before (as often as the batched path calls it)."""
    cfg = ctx.cfg
    pending: dict[Future, tuple[int, int]] = {}  # future -> (trajectory, turn)
    at_turn = [0] * max((ctx.row(i).max_turns for i in range(len(trajs))), default=0)  # turn k submitted, not back

    started = 0  # highest turn index submitted so far
    import torch

    cancels: dict[Future, threading.Event] = {}  # with an engine whose submit takes ``cancel``
    takes_cancel = "cancel" in inspect.signature(engine.submit).parameters

    base = int(torch.randint(0, 2**62, (1,)))  # one draw: each (trajectory, turn) gets its own seed
    # an engine whose steps run in the waiting thread (SlotEngine with driver "caller") waits itself
    waiter = engine.wait if callable(getattr(engine, "wait", None)) else wait


    def submit(i: int, turn: int) -> None:
        nonlocal started
        if not _fits(trajs[i], turn, ctx):
            return
        started = max(started, turn)
        at_turn[turn] += 1
        seed = (base + 1_000_003 * i + 7_919 * turn) % 2**62  # fixed whatever order turns finish in
        extra = {"constraint": ctx.constraints[i]} if ctx.constraints[i] is not None else {}
        if takes_cancel:
            extra["cancel"] = threading.Event()
        f = engine.submit(trajs[i].token_ids, cfg.max_new_tokens, cfg.temperature, greedy=greedy, stop=ctx.stop(i),
                          seed=seed, **extra)
        pending[f] = (i, turn)
        if takes_cancel:
            cancels[f] = extra["cancel"]

    try:
        for i in range(len(trajs)):
            if trajs[i].error is None:  # a failed reset is never sampled
                submit(i, 0)
        reported = 0
        while pending:
            t0 = time.perf_counter()
            done, _ = waiter(list(pending), return_when=FIRST_COMPLETED)
            dt = (time.perf_counter() - t0) / len(pending)
            for i, _ in pending.values():  # the wait's wall time, shared among the rows sampled in it
                trajs[i].timings["generate"] += dt
            for f in done:
                i, turn = pending.pop(f)
                at_turn[turn] -= 1
                if _after_turn(trajs[i], f.result(), turn, tool_maps[i], envs[i], ctx, ctx.constraints[i],
                               ctx.row(i)) and _next_constraint(ctx, i, envs[i], trajs[i]):
                    submit(i, turn + 1)
            while reported <= started and not any(at_turn[:reported + 1]):
                reported += 1
                if on_turn is not None:
                    on_turn()
    except BaseException:  # a failed row, tool or hook: the rows still decoding stop, their slots free
        for f in pending:
            if f in cancels:
                cancels[f].set()
        raise


def offered_tools(tools: list[Tool], env: Environment | None) -> list[Tool]:
    """The tools as the grammar offers them this turn: ``tools`` plus the environment's, whose
    schemas an environment may narrow to its current state with an optional
    ``turn_tools() -> list[Tool] | None`` (e.g. the web browser: only the ids on the page
    shown); None, or no such method, offers its ``tools`` as they are. Only the grammar
    changes: calls still go to the environment's ``tools``."""
    if env is None:
        return tools
    narrowed = env.turn_tools() if callable(getattr(env, "turn_tools", None)) else None
    return tools + (env.tools if narrowed is None else narrowed)


def _next_constraint(ctx: _TurnContext, i: int, env: Environment | None, tr: Trajectory) -> bool:
    """Before trajectory ``i``'s next turn: its grammar again, when the environment narrows its
    tools per turn. False when ``turn_tools()`` raised (recorded as ``tr.error``: it ends)."""
    if ctx.constraints[i] is not None and callable(getattr(env, "turn_tools", None)):
        try:
            ctx.constraints[i] = turn_constraint(ctx.row(i), offered_tools(ctx.tools[i], env))
        except Exception as e:
            tr.error = env_failure("turn_tools()", e)
            return False
    return True


def turn_constraint(cfg: RolloutConfig, tools: list[Tool]):
    """The grammar every assistant turn is sampled under (``rollout.constrain``), or None.

    ``"tool_call"``: exactly one ``<tool_call>`` to one of ``tools`` with arguments valid
    against its schema (:func:`selfrl.chat.constrain.tool_call_constraint`). (:func:`rollout`
    refuses a constrained task without tools.)
    """
    if cfg.constrain == "none" or not tools:
        return None
    from selfrl.chat.constrain import tool_call_constraint

    return tool_call_constraint([(t.name, t.parameters) for t in tools])


def run_tool_calls(tr: Trajectory, calls: list[ParsedCall], tool_map: dict[str, Tool], wrap: bool = True) -> list[str]:
    """Execute ``calls`` in order, append their records and tool messages to ``tr``; returns
    the tool messages' contents (``wrap``: inside ``<tool_response>`` tags, unless the chat
    template adds them). Never raises: a failed call's error goes to the model."""
    records = [execute_call(c, tool_map) for c in calls]
    tr.tool_calls += records
    contents = [format_tool_response(r, wrap) for r in records]
    tr.messages += [{"role": "tool", "content": c} for c in contents]
    return contents


def scripted_rollout(
    policy: ScriptedPolicy, tasks: list[Task], tools: list[Tool], cfg: RolloutConfig,
    env_factory: EnvFactory | None = None, group_ids: list[str] | None = None,
) -> list[Trajectory]:
    """``rollout`` with a scripted policy instead of a model: same prompts (rendered without a
    chat template), tool handling, turn limit and environment hooks; no token ids.

    Returns:
        one trajectory per task; ``token_ids``, ``completion_mask`` and ``logprobs`` are empty.
    """
    out = []
    for j, task in enumerate(tasks):
        cfg_j = task_rollout_config(cfg, task)
        shared = resolve_tools(task_overrides(task)["tools"]) if "tools" in task_overrides(task) else tools
        env, error = make_env(env_factory, task)
        try:
            env_tools = env.tools if env is not None else []
            demonstration = env.demonstration if env is not None else None
        except Exception as e:
            error, env_tools, demonstration = env_failure("setup (tools, demonstration)", e), [], None
        t_tools = shared + env_tools
        tool_map = {t.name: t for t in t_tools}
        msgs = initial_messages(task, t_tools, cfg_j, None, demonstration)
        tr = Trajectory(task_id=task.id, group_id=group_ids[j] if group_ids else task.id, adapter_version=0,
                        messages=msgs, timings={"generate": 0.0, "tools": 0.0}, error=error)
        for turn in range(cfg_j.max_turns if error is None else 0):
            text = policy(task, tr.messages)
            tr.messages.append({"role": "assistant", "content": text})
            tr.num_turns += 1
            rest, calls = parse_tool_calls(text)
            tr.final_answer = rest
            if not calls or turn == cfg_j.max_turns - 1:
                break
            run_tool_calls(tr, calls, tool_map)
            try:
                if env is not None and env.is_completed():
                    break
            except Exception as e:
                tr.error = env_failure(f"is_completed() after turn {turn + 1}", e)
                break
        finish_env(tr, env)
        out.append(tr)
    return out
