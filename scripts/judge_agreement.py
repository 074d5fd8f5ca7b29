"""How well a judge agrees with a hidden verifier: the policy's rollouts on tasks that have a
verifier (``chain_sum`` by default; ``function_calling``, or any environment with ``--rubric``),
judged by an OpenAI-compatible endpoint that never sees the reference answers, compared with the
verifier's verdicts.

    # 1. sample rollouts once (the embedded model by default), kept in a JSONL file
    PYTHONPATH=$PWD python scripts/judge_agreement.py sample --out /tmp/rollouts.jsonl --tasks 16 --generations 8
    # 2. judge them, e.g. with selfrl serve --no-learn --port 8231 holding the embedded model
    PYTHONPATH=$PWD python scripts/judge_agreement.py judge --rollouts /tmp/rollouts.jsonl \
        --base-url http://127.0.0.1:8231/v1 --mode group [--explain]
    # function calling: the environment, its options and its rollout settings from the run's config
    PYTHONPATH=$PWD python scripts/judge_agreement.py sample --config configs/function_calling.toml --out /tmp/fc.jsonl
    PYTHONPATH=$PWD python scripts/judge_agreement.py judge --config configs/function_calling.toml \
        --rollouts /tmp/fc.jsonl --base-url http://127.0.0.1:8231/v1

The environment, its ``[task] options`` and the ``[rollout]`` settings (temperature, tools, a
grammar, turns) come from ``--config`` with the environment's own defaults under it (as
``selfrl run`` layers them); ``--env`` names the environment (it overrides the file's
``task.source``). ``judge`` must be given the same ``--config``/``--env``, ``--tasks`` and
``--seed`` as ``sample``: it rebuilds the tasks to find the verifier's verdicts.

Prints one markdown row: the environment, trajectories judged and failed (unreadable or timed
out), the AUC of the judge's score against the verifier's verdict over all trajectories, the within-group
pairwise accuracy (over every pair of one correct and one wrong answer to the same task: the
share the judge orders right, a tie counting one half; 0.5 is chance, and it is what GRPO's
group-centred advantages depend on), the mean within-group Spearman correlation (groups with
both right and wrong answers and a non-constant score), the judge's tokens and its wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ARITHMETIC_RUBRIC = ("The final answer, written as <answer>NUMBER</answer>, must be the exact value of the "
                     "arithmetic expression in the task. Check the arithmetic step by step. A wrong or missing "
                     "number scores 0.")
# The judge sees the system message (the functions offered, as the policy saw them), the user's
# request and the call; never the reference answer.
FUNCTION_CALLING_RUBRIC = (
    "The answer must be a call, written as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, to the "
    "function offered in the task's system message that does what the user asks, with every required argument "
    "given and each value the one the request states (the right numbers, names, units and types; no invented "
    "arguments). Check the function's name, then each argument against the request and the function's "
    "parameters. The wrong function, a missing required argument or a wrong value scores 0; if no offered "
    "function fits the request, the right answer makes no call.")
RUBRICS = {"chain_sum": ARITHMETIC_RUBRIC, "arithmetic": ARITHMETIC_RUBRIC, "basic_arithmetic": ARITHMETIC_RUBRIC,
           "function_calling": FUNCTION_CALLING_RUBRIC}


def load(a: argparse.Namespace):
    """``(RunConfig, Env)`` of ``--config`` (None: the defaults) with ``--env`` over its ``task.source``
    and ``--model`` (sample only) over its model; the environment's ``config_defaults`` lowest.

    Raises:
        SystemExit: the config is bad, or the environment is unknown (the registry's message, which
            lists the valid names) or refuses its options.
    """
    from selfrl.config import ConfigError
    from selfrl.envs import get_env, load_run_config

    overrides = {k: v for k, v in {"task.source": a.env, "model.name": getattr(a, "model", None)}.items()
                 if v is not None}
    try:
        cfg = load_run_config(a.config, overrides)
        return cfg, get_env(cfg.task.source, **cfg.task.options)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"judge_agreement: {e}") from None


def sample(a: argparse.Namespace) -> None:
    import torch

    from selfrl.engines import make_engine
    from selfrl.model.load import build_policy
    from selfrl.rollout.agent import rollout
    from selfrl.core.tools import resolve_tools

    cfg, env = load(a)
    torch.manual_seed(a.seed)
    tasks = env.sample(a.tasks, a.seed)
    model, tok = build_policy(cfg)
    engine = make_engine(cfg.engine, model, tok, driver="caller")
    t0 = time.perf_counter()
    trajs = rollout(engine, [t for t in tasks for _ in range(a.generations)],
                    [f"g{i}" for i, _ in enumerate(tasks) for _ in range(a.generations)],
                    resolve_tools(cfg.rollout.tools), cfg.rollout, env_factory=env.make_env)
    with open(a.out, "w") as f:
        for t in trajs:
            f.write(t.to_json() + "\n")
    right = sum(env.correct(next(x for x in tasks if x.id == t.task_id), env.trajectory_answer(t)) for t in trajs)
    print(f"{len(trajs)} rollouts of {cfg.model.name} on {a.tasks} {cfg.task.source} tasks (seed {a.seed}) in "
          f"{time.perf_counter() - t0:.0f} s; verifier: {right} right; written to {a.out}")


def auc(pos: list[float], neg: list[float]) -> float:
    """P(a random positive scores above a random negative), ties one half (Mann-Whitney U / (n m))."""
    if not pos or not neg:
        return float("nan")
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def judge(a: argparse.Namespace) -> None:
    from selfrl.config import JudgeConfig, JudgeEndpoint
    from selfrl.judge import JUDGE
    from selfrl.judge.detectors import spearman
    from selfrl.envs.rewards import score_group
    from selfrl.core.trajectory import Trajectory

    cfg, env = load(a)
    rubric = a.rubric or RUBRICS.get(cfg.task.source)
    if rubric is None:
        raise SystemExit(f"judge_agreement: no rubric for environment {cfg.task.source!r} (built in: "
                         f"{', '.join(RUBRICS)}); pass --rubric TEXT, what a right answer to its tasks is")
    trajs = [Trajectory.from_dict(json.loads(line)) for line in Path(a.rollouts).read_text().splitlines()]
    tasks = {t.id: t for t in env.sample(a.tasks, a.seed)}
    missing = {t.task_id for t in trajs} - set(tasks)
    if missing:
        raise SystemExit(f"judge_agreement: {len(missing)} task(s) of {a.rollouts} are not among --tasks {a.tasks} "
                         f"of --seed {a.seed}: pass the values used to sample")
    endpoint = JudgeEndpoint(name="judge", base_url=a.base_url, model=a.model_id, rubric=rubric, mode=a.mode,
                             explain=a.explain, deadline_s=a.deadline, retries=1, max_concurrency=a.concurrency,
                             max_tokens=a.max_tokens)
    JUDGE.configure(JudgeConfig(endpoints=[endpoint], cache=False, disagreement=1.0))
    groups = defaultdict(list)
    for t in trajs:
        groups[t.group_id].append(t)
    t0 = time.perf_counter()
    for g in groups.values():
        score_group(g, tasks[g[0].task_id], env, {"judge": 1.0})
    seconds = time.perf_counter() - t0
    metrics = JUDGE.pop_metrics()
    JUDGE.close()
    scored = [t for t in trajs if t.reward is not None]
    pos = [t.reward for t in scored if t.correct]
    neg = [t.reward for t in scored if not t.correct]
    pairs, rhos = [], []
    for g in groups.values():
        s = [t for t in g if t.reward is not None]
        pairs += [(r.reward > w.reward) + 0.5 * (r.reward == w.reward)
                  for r in s if r.correct for w in s if not w.correct]
        rho = spearman([float(bool(t.correct)) for t in s], [t.reward for t in s]) if len(s) > 2 else None
        if rho is not None:
            rhos.append(rho)
    failed = len(trajs) - len(scored)
    print("| judge | task | mode | reasons | judged | failed | right (verifier) | AUC | within-group pairwise accuracy "
          "(pairs) | within-group Spearman (groups) | mean score right / wrong | input / output tokens | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mean = lambda v: statistics.fmean(v) if v else float("nan")  # noqa: E731
    print(f"| {a.label} | {cfg.task.source} | {a.mode} | {'yes' if a.explain else 'no'} | {len(scored)} | {failed} | "
          f"{len(pos)} | "
          f"{auc(pos, neg):.3f} | {mean(pairs):.3f} ({len(pairs)}) | {mean(rhos):.3f} ({len(rhos)}) | "
          f"{mean(pos):.2f} / {mean(neg):.2f} | {metrics['judge/input_tokens']:.0f} / "
          f"{metrics['judge/output_tokens']:.0f} | {seconds:.0f} |")
    if failed:
        first = next(t.error for t in trajs if t.reward is None)
        print(f"first failure: {first}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="roll out the policy and keep the trajectories")
    s.add_argument("--out", required=True)
    s.add_argument("--model", default=None, help="the policy (default: the config's model.name, the embedded "
                   "SmolLM2-135M-Instruct unless the config names another)")
    j = sub.add_parser("judge", help="judge kept rollouts and compare with the verifier")
    j.add_argument("--rollouts", required=True)
    j.add_argument("--base-url", required=True, help="the judge's OpenAI-compatible base URL (.../v1)")
    j.add_argument("--model-id", default="selfrl", help="the model id sent to the endpoint")
    j.add_argument("--mode", choices=["pointwise", "group"], default="group")
    j.add_argument("--explain", action="store_true", help="ask for a reason before each score")
    j.add_argument("--label", default="embedded SmolLM2-135M (selfrl serve)")
    j.add_argument("--deadline", type=float, default=300.0)
    j.add_argument("--concurrency", type=int, default=4)
    j.add_argument("--max-tokens", type=int, default=768)
    j.add_argument("--rubric", default=None, help="what a right answer is (default: the built-in rubric of "
                   f"the environment: {', '.join(RUBRICS)})")
    for p in (s, j):
        p.add_argument("--tasks", type=int, default=16)
        p.add_argument("--generations", type=int, default=8)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--config", default=None, help="a run config (TOML): its [task] source and options, "
                       "[rollout] settings and model; the environment's defaults under it")
        p.add_argument("--env", default=None, help="the environment (default: the config's task.source, "
                       "chain_sum without --config)")
    a = ap.parse_args(argv)
    sample(a) if a.cmd == "sample" else judge(a)


if __name__ == "__main__":
    main()
