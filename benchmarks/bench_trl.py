"""Held-out success against wall-clock time: selfrl and TRL's GRPOTrainer learning BFCL function calling.

One arm per invocation, then one figure and table over the arms' JSON files:

    nice -n 19 python benchmarks/bench_trl.py --arm trl --grammar --minutes 30 --seed 0
    nice -n 19 python benchmarks/bench_trl.py --arm selfrl --minutes 30 --seed 0
    nice -n 19 python benchmarks/bench_trl.py --arm trl --minutes 30 --seed 0
    nice -n 19 python benchmarks/bench_trl.py --arm selfrl --no-grammar --minutes 30 --seed 0
    nice -n 19 python benchmarks/bench_trl.py --arm selfrl --gate-every 4 --minutes 30 --seed 0
    python benchmarks/bench_trl.py plot benchmarks/results/trl_*_seed0.json --png docs/results/trl_curve.png
    python benchmarks/bench_trl.py --arm trl --tiny --minutes 1      # tiny random model (smoke test)

The job is ``configs/function_calling.toml``: BFCL ``simple`` tasks whose functions take at
most 3 parameters, one turn, the ``function_calling-partial`` reward (0.5 for the right
function, 0.5 x the share of right argument values, 1 only for BFCL's exact AST match).
Both arms train the same model (``embedded:smollm2-135m-instruct``, fp32, on the CPU) with a
LoRA adapter of the same shape (r 16, alpha 32, no dropout, every linear layer), on selfrl's
training split walked in selfrl's order (``selfrl.run.loop.iteration_tasks``: 4 tasks x 6
samples per update), with the same sampling temperature (1.0, no top-k or top-p), learning rate
(2e-4, constant), loss (``dapo``), clip range (0.2), KL weight (``beta`` 0.02), reward scaling
(per group) and gradient clipping (1.0). An arm process trains for ``--minutes`` of training
time and keeps every update's adapter; then a second process scores the adapters reached at
every ``--eval-every`` seconds with selfrl's validation (``selfrl.safety.gate.validate``:
greedy, the 64 held-out tasks of the config, success = exact AST match), the same way for both
arms, and the base model (time 0).

Training time: selfrl's is the sum of its iterations (rollouts, rewards, update, saving the
candidate version; with ``--gate-every``, the gate's validations and any collapse cool-down too); TRL's is the time since ``on_train_begin`` at the end of each optimizer
step, less the time this script spends saving its adapters. Loading the model, selfrl's
validation of the base model before its first update, and the evaluation are not counted.
Each arm runs alone: run them one after the other on an otherwise idle machine.

Where the arms cannot be the same:

* **Grammar.** selfrl samples each turn under the config's ``tool_call`` grammar (one call to
  the offered function, arguments valid against its schema); TRL 1.16's GRPOTrainer
  constrains decoding only through vLLM, so by itself it samples freely. ``--arm trl
  --grammar`` gives TRL's ``generate`` selfrl's grammar masks as a logits processor
  (``trl_setup.constrain_generation``): the same completions can be sampled, but TRL's loss
  keeps the unmasked log-probabilities, where selfrl's learner replays the masks.
  ``--arm selfrl --no-grammar`` trains selfrl without the grammar (``rollout.constrain =
  "none"``). Each arm is compared with the TRL arm that sampled as it did. The held-out
  evaluation uses the grammar for every arm (``--eval-constrain none`` evaluates without it).
* **Gate.** By default the selfrl arm runs without its held-out gate (no validation counts
  against its time), so a collapse rolls back to the base; ``--gate-every N`` gates every N
  updates as a shipped config does, counts the validations as training time, and the curve
  scores the version the gate serves. The gate validates on the same held-out tasks the curve
  scores, which flatters that arm.
* **Stop.** selfrl stops a turn at ``</tool_call>`` (``rollout.stop_at_tool_call``); TRL stops
  only at the end of turn or at 64 tokens, so it samples and trains on tokens after the call.
  Its reward sees the completion up to the first ``</tool_call>``, as selfrl's would.
* **Reward.** TRL calls selfrl's reward (``selfrl.envs.rewards.score_batch`` with the
  ``function_calling-partial`` preset) on a one-turn trajectory holding its completion; a
  reward function that raises fails the TRL step (TRL has no way to leave one sample out).
* **The update.** selfrl skips sequences whose advantage is 0, and its update guards
  (``train.skip_max_*``) may skip an update; TRL trains on every completion. selfrl's
  collapse rules may roll back to an earlier version; TRL has none.
* **Prompt.** TRL gets selfrl's prompt as text (system prompt, tool description, the worked
  example, the question, rendered by the chat template); ``prompt_ids_match`` in the JSON
  counts the tasks whose tokens TRL's tokenizer call gives exactly as selfrl's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT, base_parser, command_line, envelope, finish, in_memory_dataset, loadavg, model_name, peak_rss_bytes,
    print_table, run_child,
)
from trl_compare import count_updates, plot, rate  # noqa: E402
from trl_setup import constrain_generation, grpo_args, grpo_trainer, load_trainable, step_timeline  # noqa: E402

CONFIG = ROOT / "configs" / "function_calling.toml"
ARMS = ("trl", "selfrl")
TOOL_CALL_CLOSE = "</tool_call>"
# --tiny: a random 2-layer model, short turns, a small held-out set (the job itself is unchanged)
TINY = {"rollout.max_new_tokens": 16, "gate.val_size": 8, "gate.batch_size": 8}


def arm_label(arm: str, grammar: bool, gated: bool = False) -> str:
    """``selfrl`` / ``selfrl-free`` (selfrl with / without the grammar; ``-gated`` added with
    ``--gate-every``), ``trl`` / ``trl-grammar`` (TRL sampling freely, as it does by itself /
    under selfrl's grammar).

    >>> arm_label("selfrl", False), arm_label("selfrl", True, gated=True), arm_label("trl", True)
    ('selfrl-free', 'selfrl-gated', 'trl-grammar')
    """
    if arm == "trl":
        return "trl-grammar" if grammar else "trl"
    return arm + ("" if grammar else "-free") + ("-gated" if gated else "")


def arm_config(args: argparse.Namespace, workdir: Path):
    """The run config of one arm: ``configs/function_calling.toml`` (with the environment's
    defaults under it) with ``--seed``, the run folder in ``workdir``, no validation while
    training (``--gate-every N``: the gate every N updates), ``rollout.constrain = "none"``
    without the grammar and ``gate.batch_size`` =
    ``--eval-batch-size`` when given."""
    from selfrl.envs import load_run_config

    overrides = {"model.name": model_name(args, workdir), "run_dir": str(workdir / "run"), "seed": args.seed,
                 "iterations": 1_000_000, "gate.eval_every": args.gate_every or 1_000_000}
    if not args.grammar:
        overrides["rollout.constrain"] = "none"
    if args.eval_batch_size is not None:
        overrides["gate.batch_size"] = args.eval_batch_size
    if args.tiny:
        overrides.update(TINY)
    return load_run_config(CONFIG, overrides)


# ------------------------------------------------------------------ workers (one process each)


def worker_selfrl(cfg_dict: dict, budget_s: float, out: Path) -> None:
    """``selfrl run``'s loop (:class:`selfrl.run.loop.Runner`), one iteration after another
    until ``budget_s`` seconds of iterations have passed; writes each update's end time
    (seconds of training, the gate's validations included when it gates), version folder (the
    newest candidate's; the champion's when the run gates), mean reward and update note to ``out``.
    A collapse cool-down (``collapse.max_per_window``) is waited out and counted as training
    time, and a collapse stop (``collapse.max_rollbacks``) ends training, as in ``selfrl run``."""
    from selfrl.config import load_config
    from selfrl.record.adapters import version_dir
    from selfrl.run.loop import Runner
    from selfrl.run.progress import PlainProgress
    from selfrl.run.setup import build_run
    from selfrl.safety.collapse import CollapseStop

    cfg = load_config(base=cfg_dict)
    gated = cfg.gate.eval_every < cfg.iterations
    runner = Runner(build_run(cfg), PlainProgress())
    steps, elapsed, t_wall, waited, stopped = [], 0.0, time.perf_counter(), 0.0, None
    try:
        runner.start()  # validates the base model: not counted
        while elapsed < budget_s:
            it = len(steps)
            try:  # as selfrl.run.loop.Runner.run: a collapse cool-down is waited out, a collapse stop ends training
                wait = min(runner.s.cycle.check_budget(), budget_s - elapsed)
            except CollapseStop as e:
                stopped = str(e)
                break
            if wait > 0:
                time.sleep(wait)
                elapsed, waited = elapsed + wait, waited + wait
                continue
            t = time.perf_counter()
            metrics = runner.iteration(it)
            if gated and (it + 1) % cfg.gate.eval_every == 0 and runner.s.engine.version != runner.champion.version:
                runner.gate(it, runner.validate())  # as selfrl.run.loop.Runner.run gates, and timed with it
            elapsed += time.perf_counter() - t
            version = runner.s.engine.version
            # with the gate, the version a user is served is the champion, not the newest candidate
            shown = runner.champion.version if gated else version
            steps.append({"step": it + 1, "seconds": elapsed, "version": version, "champion": runner.champion.version,
                          "adapter": str(version_dir(cfg.run_dir, shown)), "reward": metrics["reward/mean"],
                          "skipped": bool(metrics.get("skipped", 0.0))})
        runner.finish(False)
    finally:
        runner.progress.close()
        if runner.s.lock is not None:
            runner.s.lock.release()
    json.dump({"steps": steps, "wall_s": time.perf_counter() - t_wall, "peak_rss_bytes": peak_rss_bytes(),
               "cooldown_s": waited, "stopped": stopped}, open(out, "w"))


def completion_trajectory(text: str, task_id: str, group_id: str):
    """A one-turn :class:`selfrl.core.trajectory.Trajectory` whose only assistant message is
    ``text`` cut after its first ``</tool_call>`` (where selfrl's rollout stops), so that
    selfrl's reward functions score it as they score a rollout of ``max_turns = 1``."""
    from selfrl.core.trajectory import Trajectory

    cut = text.find(TOOL_CALL_CLOSE)
    text = text if cut < 0 else text[:cut + len(TOOL_CALL_CLOSE)]
    return Trajectory(task_id=task_id, group_id=group_id, adapter_version=0, num_turns=1,
                      messages=[{"role": "assistant", "content": text}], env_state={"calls": []})


def worker_trl(cfg_dict: dict, budget_s: float, out: Path) -> None:
    """TRL's ``GRPOTrainer`` with a peft ``LoraConfig`` of selfrl's shape on selfrl's training
    tasks in selfrl's order, until an optimizer step ends past ``budget_s`` seconds; saves the
    adapter after every step and writes each step's end time and folder to ``out``."""
    from selfrl.chat.template import prompt_ids, render, template_supports_tools
    from selfrl.config import load_config
    from selfrl.envs import get_env
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.rollout.agent import initial_messages, turn_constraint
    from selfrl.run.loop import iteration_tasks

    cfg = load_config(base=cfg_dict)
    source = get_env(cfg.task.source, **cfg.task.options)
    train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    by_id = {t.id: t for t in train}
    weights = cfg.reward_weights or get_preset(cfg.preset)
    model, tok = load_trainable(cfg.model.name)

    prompts, matches, constraints = {}, 0, {}
    for t in train:  # the prompt of selfrl's rollout (selfrl.rollout.agent.rollout), as text
        env = source.make_env(t)
        native = [x.openai_schema() for x in env.tools] if template_supports_tools(tok) else None
        msgs = initial_messages(t, env.tools, cfg.rollout, tok, env.demonstration)
        prompts[t.id] = render(tok, msgs, add_generation_prompt=True, tools=native)
        ids = tok(text=prompts[t.id])["input_ids"]
        matches += ids == prompt_ids(tok, msgs, tools=native)
        constraint = turn_constraint(cfg.rollout, env.tools)  # None without the grammar
        if constraint is not None:
            constraints[tuple(ids)] = constraint
    # one whole cycle of selfrl's walk through the training set (num_prompts passes), which
    # TRL's epochs repeat without a seam; TRL stops on time
    order = [t for it in range(len(train)) for t in iteration_tasks(train, it, cfg.num_prompts, cfg.task.train_seed)]
    data = in_memory_dataset([{"prompt": prompts[t.id], "task_id": t.id} for t in order], f"bench-trl-{cfg.seed}")

    def selfrl_reward(prompts, completions, task_id, **kwargs):
        """selfrl's reward preset on one-turn trajectories, grouped by prompt as TRL groups them."""
        trajs = [completion_trajectory(c, tid, f"{i // cfg.num_generations}-{tid}")
                 for i, (c, tid) in enumerate(zip(completions, task_id))]
        score_batch(trajs, by_id, source, weights)
        return [t.reward for t in trajs]

    timeline = step_timeline(Path(cfg.run_dir) / "adapters", 5, budget_s=budget_s)
    steps = timeline.steps
    args = grpo_args(cfg, gradient_checkpointing=cfg.train.gradient_checkpointing, max_steps=10**9)
    trainer = grpo_trainer(cfg, model, tok, selfrl_reward, args, data, timeline)
    grammar = constrain_generation(trainer, constraints) if constraints else None
    t = time.perf_counter()
    trainer.train()
    rewards = {r["step"]: r["reward"] for r in trainer.state.log_history if "reward" in r and "step" in r}
    for s in steps:  # the step's log is written after on_step_end
        s["reward"] = rewards.get(s["step"])
    json.dump({"steps": steps, "wall_s": time.perf_counter() - t, "peak_rss_bytes": peak_rss_bytes(),
               "prompt_ids_match": [matches, len(train)], "grammar": grammar, "trl_config": args.to_dict()},
              open(out, "w"), default=str)


def worker_eval(cfg_dict: dict, adapters: dict[str, str | None], constrain: str, out: Path) -> None:
    """Held-out greedy success per task of each adapter (None: the base model) by selfrl's
    validation on the config's held-out tasks, with ``rollout.constrain = constrain``."""
    from safetensors.torch import load_file

    from selfrl.config import load_config
    from selfrl.core.tools import resolve_tools
    from selfrl.engines import make_engine
    from selfrl.envs import get_env
    from selfrl.model.load import build_policy
    from selfrl.record.adapters import lora_state
    from selfrl.safety.gate import validate

    cfg = load_config(base=cfg_dict, overrides={"rollout.constrain": constrain})
    source = get_env(cfg.task.source, **cfg.task.options)
    _, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    model, tok = build_policy(cfg)  # B = 0: the base model until an adapter is swapped in
    engine = make_engine(cfg.engine, model, tok, driver="caller")
    base = lora_state(model)
    results = {}
    for k, (name, path) in enumerate(adapters.items(), start=1):
        state = base if path is None else load_file(str(Path(path) / "adapter_model.safetensors"))
        engine.swap(state, k)  # selfrl's version folders and TRL's peft folders alike
        res = validate(engine, val, source, resolve_tools(cfg.rollout.tools), cfg.rollout, cfg.gate.batch_size)
        results[name] = {t: c for t, c, _ in res.results}
    json.dump({"results": results, "peak_rss_bytes": peak_rss_bytes()}, open(out, "w"))


WORKERS = {"selfrl": worker_selfrl, "trl": worker_trl, "eval": worker_eval}


# ------------------------------------------------------------------ one arm


def eval_points(steps: list[dict], every_s: float) -> list[tuple[float, dict | None]]:
    """The ``(time, step)`` pairs to score: ``(0, None)`` (the base model), then at ``every_s``,
    2 x ``every_s``, ... before the last step's time and at that time, the last step finished
    by then (seconds of training); a step already listed, or none yet, is not listed again.

    >>> s = [{"seconds": 50.0}, {"seconds": 130.0}, {"seconds": 170.0}]
    >>> [(t, x["seconds"]) for t, x in eval_points(s, 60.0)[1:]]
    [(60.0, 50.0), (170.0, 170.0)]

    Raises:
        ValueError: ``every_s`` is not positive.
    """
    if every_s <= 0:
        raise ValueError(f"--eval-every must be > 0 seconds, got {every_s}")
    end = steps[-1]["seconds"] if steps else 0.0
    times = [k * every_s for k in range(1, int(end // every_s) + 1) if k * every_s < end] + [end]
    points: list[tuple[float, dict | None]] = [(0.0, None)]
    for t in times:
        done = [s for s in steps if s["seconds"] <= t + 1e-9]
        if done and all(done[-1] is not s for _, s in points):
            points.append((t, done[-1]))
    return points


def run_arm(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """Train one arm in a child process, evaluate its adapters in another; write and return the result."""
    if args.arm == "trl":
        try:
            import trl
        except ModuleNotFoundError:
            raise SystemExit("--arm trl needs TRL: pip install -e '.[bench]' (or make bench-trl)") from None
        trl_version = trl.__version__
    else:
        trl_version = None
    label = arm_label(args.arm, args.grammar, gated=args.gate_every is not None)
    result = envelope(args, command_line("bench_trl.py", argv))
    workdir = args.workdir / f"{label}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True)
    cfg = arm_config(args, workdir)
    budget = args.minutes * 60.0
    train = _call(args.arm, {"cfg_dict": cfg.to_dict(), "budget_s": budget}, workdir)
    points = eval_points(train["steps"], args.eval_every)
    adapters = {"base": None, **{s["adapter"]: s["adapter"] for _, s in points if s is not None}}
    constrain = args.eval_constrain or load_config_constrain()
    scored = _call("eval", {"cfg_dict": cfg.to_dict(), "adapters": adapters, "constrain": constrain}, workdir)
    curve = []
    for t, s in points:
        per_task = scored["results"]["base" if s is None else s["adapter"]]
        curve.append({"seconds": t, "step": 0 if s is None else s["step"], "success": rate(per_task),
                      "results": per_task})
    result.update({
        "arm": args.arm, "label": label, "grammar": args.grammar, "gate_every": args.gate_every, "seed": args.seed,
        "minutes": args.minutes,
        "eval_every_s": args.eval_every, "eval_constrain": constrain, "trl_version": trl_version,
        "model": cfg.model.name, "iterations": len(train["steps"]), "updates": count_updates(train["steps"]),
        "training_s": train["steps"][-1]["seconds"] if train["steps"] else 0.0,
        "curve": curve, "train": train, "eval_peak_rss_bytes": scored["peak_rss_bytes"],
        "workdir": str(workdir), "config": cfg.to_dict(),
    })
    print_table(f"{label}, seed {args.seed}: held-out success ({len(curve[0]['results'])} tasks, "
                f"{len(train['steps'])} iterations, {result['updates']} updates, in {result['training_s']:.0f} s)",
                ["training s", "iteration", "held-out success"],
                [[f"{c['seconds']:.0f}", c["step"], f"{c['success']:.3f}"] for c in curve])
    print(f"load average: start {result['loadavg_start']:.2f}, end {loadavg():.2f}")
    print(f"wrote {finish(result, f'trl_{label}_seed{args.seed}', args.out)}")
    return result


def load_config_constrain() -> str:
    """``rollout.constrain`` of ``configs/function_calling.toml`` (the evaluation's default grammar)."""
    from selfrl.envs import load_run_config

    return load_run_config(CONFIG).rollout.constrain


def _call(worker: str, payload: dict, workdir: Path) -> dict:
    out, spec = workdir / f"{worker}.json", workdir / f"{worker}-input.json"
    spec.write_text(json.dumps(payload))
    return run_child([__file__, "--worker", worker, "--input", str(spec), "--output", str(out)], out)


USAGE = """%(prog)s [-h] --arm {trl,selfrl} [--minutes MINUTES] [--seed SEED] [--grammar | --no-grammar] [options]
       %(prog)s plot RESULT.json [RESULT.json ...] [--png PNG] [--levels LEVELS] [--out OUT]"""
EPILOG = ("Subcommand: bench_trl.py plot RESULT.json ... draws the figure and the table over the JSON files "
          "the arms wrote (bench_trl.py plot --help lists its flags).")


def main(argv: list[str] | None = None) -> dict:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["plot"]:
        return plot(raw[1:])
    p = base_parser(__doc__, repeats=False)
    p.prog, p.usage, p.epilog = "bench_trl.py", USAGE, EPILOG
    p.add_argument("--arm", choices=ARMS, help="which trainer this invocation runs")
    p.add_argument("--minutes", type=float, default=30.0, help="training time of the arm (minutes)")
    p.add_argument("--seed", type=int, default=0, help="run seed (LoRA initialisation, sampling)")
    p.add_argument("--grammar", dest="grammar", action="store_const", const=True, default=None,
                   help="sample the training turns under the config's tool-call grammar (the default for "
                        "selfrl; for TRL, which constrains decoding only through vLLM, selfrl's grammar masks "
                        "become a logits processor on its generate)")
    p.add_argument("--no-grammar", dest="grammar", action="store_const", const=False,
                   help="sample without the grammar (the default for TRL)")
    p.add_argument("--gate-every", type=int, default=None,
                   help="selfrl only: validate and gate every N updates, as a shipped config does (default: no "
                        "gate while training); its validations count as training time, and the curve scores the "
                        "version the gate serves")
    p.add_argument("--eval-every", type=float, default=120.0, help="score the adapter reached every this many seconds")
    p.add_argument("--eval-constrain", choices=("tool_call", "none"), default=None,
                   help="the held-out evaluation's grammar (default: the config's, tool_call)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="held-out tasks decoded at once (default: the config's gate.batch_size, 64; less memory)")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-trl", help="run folders and adapters")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        WORKERS[args.worker](**json.loads(args.input.read_text()), out=args.output)
        return {}
    if args.arm is None:
        p.error("pass --arm trl or --arm selfrl (or the plot subcommand: bench_trl.py plot RESULT.json ...)")
    if args.grammar is None:
        args.grammar = args.arm == "selfrl"
    # checked before the arm trains for --minutes, not after (NaN and infinities included)
    if not (math.isfinite(args.eval_every) and args.eval_every > 0):
        p.error(f"--eval-every takes seconds > 0, got {args.eval_every:g}")
    if args.eval_batch_size is not None and args.eval_batch_size < 1:
        p.error(f"--eval-batch-size takes a number of tasks >= 1, got {args.eval_batch_size}")
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        p.error(f"--minutes takes minutes > 0, got {args.minutes:g}")
    if args.seed < 0:
        p.error(f"--seed takes an integer >= 0, got {args.seed}")
    if args.gate_every is not None and (args.arm != "selfrl" or args.gate_every < 1):
        p.error("--gate-every takes a number of updates >= 1, for --arm selfrl (TRL has no gate)")
    return run_arm(args, argv)


if __name__ == "__main__":
    main()
