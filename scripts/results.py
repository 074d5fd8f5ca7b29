"""Every learning result re-run by one command, and one table of them: per environment and seed,
the base model, the best k-shot prompt and RL, with paired 95 % intervals on the same held-out tasks.

    python scripts/results.py run   --envs function_calling code_easy --seeds 0 1 2 [--out runs/results]
    python scripts/results.py table --envs function_calling code_easy --seeds 0 1 2 [--out runs/results]
    make results ENVS="function_calling code_easy" SEEDS="0 1 2"       # both, in turn

``run``: for each environment, its shipped config (:data:`ENVIRONMENTS`) is run as it ships:
``scripts/prompt_baseline.py`` once per shot count k (greedy, so one run per k is the result;
``--per-task`` keeps each task's verdict in ``OUT/ENV/prompt-kK.json``), then
``selfrl run --config CONFIG --seed S --run-dir OUT/ENV/seedS`` per seed. Each step's command and
wall time go to ``OUT/ENV/steps.json`` when it ends, with the code it ran on (:func:`code_version`:
the commit, and whether tracked files differed from it); a step recorded as finished is skipped, so
running the same command again resumes where it stopped (an interrupted RL run continues with
``selfrl run --resume``, its wall time summed over the attempts). A failing step stops the run
with its exit status.

``table``: reads the run folders' stores and the prompt files and writes ``OUT/results.md`` and
``OUT/results.json``: per environment and seed, the base (version 0's held-out evaluation), the
best prompt (the k with the most held-out successes; a tie goes to the smaller k), RL (the version
the run serves by its ``gate.rule``: the base when nothing was promoted), each with its Wilson
interval, and the paired differences RL - base and RL - best prompt with their 95 % intervals
(``selfrl.core.stats``). Every number is on the run's held-out tasks: the prompt files must hold
exactly the same task ids, and no held-out task may appear among the tasks the run trained on;
either mismatch stops the table with an error naming the files.

Each row also says what the run cost, read from its store (:mod:`selfrl.report.cost`):
``rollouts`` (``rl``: the trajectories it sampled for RL, every session's; ``warm_start``: the
warm start's samples), ``cost_s`` (seconds of the iterations' rollouts and updates, of every
held-out validation, and of the warm start's sampling and fine-tuning), ``cost_ratio``
((rollouts + updates) / rollouts over the iterations, as ``benchmarks/bench_cost.py`` has it;
None before the first iteration) and ``warm_start`` (None when the config has it off, else its
outcome, or ``"not recorded"`` when it stopped before recording anything: then its samples and
seconds are None, not guessed). ``results.md`` shows the rollouts and the ratio in the table and
the seconds under "Cost".

``results.md`` ends with the code each step ran on: one line when every step ran on one commit,
else one line per step (a step resumed on other code lists each).

A seed whose run has not finished (still running, interrupted or killed midway: fewer updates
logged than its config's ``iterations``, or its last candidate not yet gated;
:mod:`selfrl.report.finished`) keeps its row, with what it has so far, but the row says
``unfinished: iteration K of N`` instead of a verdict, and the seed is left out of the
"RL beats the best prompt in X of N seeds" count (the line says how many were left out); a
note on stderr names it. A run that stopped itself for good (``collapse.max_rollbacks`` spent,
``task.signal_check = "stop"``) is finished. A seed without a run, or whose base was not
evaluated yet, stops the table with an error: finish it with ``run``, or leave it out with ``--seeds``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from selfrl.report.cost import RunCost
    from selfrl.report.finished import RunProgress

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Environment:
    """One row group of the table: the shipped config, the shot counts of its prompt baseline, and
    the arguments its prompt baseline needs beyond them (``scripts/prompt_baseline.py --set ...``)."""

    config: str  # relative to the repository root
    shots: tuple[int, ...]
    prompt_args: tuple[str, ...] = ()


ENVIRONMENTS = {
    "arithmetic": Environment("configs/demo.toml", (0, 1, 2)),
    "function_calling": Environment("configs/function_calling.toml", (0, 1, 3, 5)),
    "function_calling_warm": Environment("configs/function_calling_warm.toml", (0, 1, 3, 5)),
    "function_calling_live": Environment("configs/function_calling_live.toml", (0, 1, 3, 5)),
    "code_easy": Environment("configs/code_easy.toml", (0, 1, 3)),
    "code_easy_warm": Environment("configs/code_easy_warm.toml", (0, 1, 3)),
    "web_easy": Environment("configs/web_easy.toml", (0, 1, 2, 3, 4)),
    # 116 instances: 64 held out and 50 trained on leave 2 to show as solved examples; the prompts
    # take theirs from a training pool of 40 (the held-out 64 come first and do not change)
    "swe_choice": Environment("configs/swe_choice_64.toml", (0, 1, 3), ("--set", "task.num_train=40")),
}
LEDGER = "steps.json"


def environment(name: str) -> Environment:
    """The :data:`ENVIRONMENTS` entry of ``name``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; valid: {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


# ------------------------------------------------------------------ run


def selfrl_program() -> str:
    """The ``selfrl`` console script beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / "selfrl"
    found = str(beside) if beside.is_file() else shutil.which("selfrl")
    if found is None:
        raise OSError("no selfrl command beside this Python nor on PATH: install the project (make install)")
    return found


def execute(argv: list[str]) -> int:
    """Run ``argv`` from the repository root, its output passed through; its exit status."""
    return subprocess.run(argv, cwd=ROOT).returncode


def code_version(root: Path = ROOT) -> str:
    """The code a step runs on: ``root``'s commit (12 hex digits), ``"<commit> with uncommitted
    changes"`` when a tracked file differs from it, or ``"unknown (not a git checkout)"`` when
    git cannot say (no git, no commit yet, or ``root`` is not the top of a repository: a folder
    inside another one would report that one's commit). Git's ``GIT_*`` variables (``GIT_DIR``,
    ``GIT_WORK_TREE``...) are not passed on: they would name another repository's commit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              env=env).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return "unknown (not a git checkout)"
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes" if dirty else commit


def read_ledger(folder: Path) -> dict[str, dict[str, Any]]:
    """``{step: {"command", "wall_s", "attempts", "finished", "code"}}`` of ``folder/steps.json``
    ({} if none); ``code``: the :func:`code_version` of each attempt, without repeats."""
    path = folder / LEDGER
    return read_json(path, "delete it to run every step again", '{"step": {"command", "wall_s", ...}}') \
        if path.exists() else {}


def read_json(path: Path, fix: str, shape: str) -> dict[str, dict[str, Any]]:
    """The JSON object of ``path``: an object whose every value is an object.

    Raises:
        ValueError: the file is not JSON (a run stopped while writing it, or an edit), or not of
            that shape (``shape`` describes it): the message names the file and ``fix``, what to do.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}): {fix}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path} is JSON but not {shape}: {fix}")
    return data


def record_step(folder: Path, step: str, command: str, wall_s: float, finished: bool,
                code: str | None = None) -> dict[str, Any]:
    """Add one attempt of ``step`` to the ledger (wall time summed over attempts, ``code`` added to
    the codes it ran on; None: :func:`code_version`), written atomically."""
    from selfrl.core.atomic import write_atomic

    ledger = read_ledger(folder)
    before = ledger.get(step, {})
    code = code_version() if code is None else code
    entry = {"command": command, "wall_s": before.get("wall_s", 0.0) + wall_s,
             "attempts": before.get("attempts", 0) + 1, "finished": finished,
             "code": list(dict.fromkeys([*before.get("code", []), code]))}
    ledger[step] = entry
    write_atomic(folder / LEDGER, json.dumps(ledger, indent=1, sort_keys=True))
    return entry


def shown(argv: list[str]) -> str:
    """``argv`` as a user types it: ``selfrl`` and ``python`` by name, paths relative to the repository."""
    names = {sys.executable: "python"}
    try:
        names[selfrl_program()] = "selfrl"
    except OSError:
        pass
    return shlex.join(names.get(a, a.removeprefix(f"{ROOT}/")) for a in argv)


def steps(name: str, env: Environment, seeds: list[int], out: Path) -> list[tuple[str, list[str], Path]]:
    """``[(step, argv, its output)]`` of one environment, prompt baselines first. An RL run whose
    folder already holds a store (an interrupted attempt) continues with ``--resume``."""
    folder = out / name
    todo = []
    for k in env.shots:
        per_task = folder / f"prompt-k{k}.json"
        todo.append((f"prompt-k{k}", [sys.executable, "scripts/prompt_baseline.py", "--config", env.config,
                                      "--shots", str(k), *env.prompt_args, "--per-task", str(per_task)], per_task))
    for seed in seeds:
        run_dir = folder / f"seed{seed}"
        if (run_dir / "selfrl.db").exists():
            argv = [selfrl_program(), "run", "--resume", str(run_dir)]
        else:
            argv = [selfrl_program(), "run", "--config", env.config, "--seed", str(seed), "--run-dir", str(run_dir)]
        todo.append((f"seed{seed}", argv, run_dir / "selfrl.db"))
    return todo


def run_all(envs: list[str], seeds: list[int], out: Path, runner: Callable[[list[str]], int] = execute) -> int:
    """Run every step not yet finished; 0, or the exit status of the first step that failed.

    Args:
        envs: names of :data:`ENVIRONMENTS`.
        seeds: RL seeds, one run each.
        out: the results folder (``OUT/ENV/...``), created if missing.
        runner: runs one command and returns its exit status (:func:`execute`).

    Raises:
        ValueError: an unknown environment (before anything runs).
    """
    plan = [(name, environment(name)) for name in envs]
    for name, env in plan:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for step, argv, output in steps(name, env, seeds, out):
            done = read_ledger(folder).get(step, {})
            if done.get("finished") and output.exists():
                print(f"results: {name} {step}: finished before ({done['wall_s']:.0f} s), skipped", flush=True)
                continue
            print(f"results: {name} {step}: {shown(argv)}", flush=True)
            code = code_version()  # before it runs: the code it starts on
            t0 = time.perf_counter()
            rc = runner(argv)
            entry = record_step(folder, step, shown(argv), time.perf_counter() - t0, rc == 0, code)
            if rc != 0:
                print(f"results: error: {name} {step} exited with status {rc} after {entry['wall_s']:.0f} s; "
                      "fix the cause and run the same command again to resume", file=sys.stderr)
                return rc
    return 0


# ------------------------------------------------------------------ table


def rate(results: dict[str, bool]) -> dict[str, Any]:
    """``{"successes", "n", "rate", "low", "high"}``: the success rate with its 95 % Wilson interval."""
    from selfrl.core.stats import wilson_interval

    k, n = sum(results.values()), len(results)
    low, high = wilson_interval(k, n)
    return {"successes": k, "n": n, "rate": k / n if n else 0.0, "low": low, "high": high}


def paired(before: dict[str, bool], after: dict[str, bool]) -> dict[str, float]:
    """``{"diff", "low", "high"}``: mean of ``after - before`` over the shared task ids, 95 % CI.

    Raises:
        ValueError: the two hold different task ids.
    """
    from selfrl.core.stats import paired_difference_ci

    if before.keys() != after.keys():
        raise ValueError(f"paired results on different tasks: {len(before.keys() - after.keys())} only before, "
                         f"{len(after.keys() - before.keys())} only after")
    ids = sorted(before)
    diff, low, high = paired_difference_ci([before[t] for t in ids], [after[t] for t in ids])
    return {"diff": diff, "low": low, "high": high}


def read_prompts(folder: Path, held_out: set[str], where: str) -> dict[int, dict[str, bool]]:
    """``{k: {task id: solved}}`` of every ``prompt-kK.json`` in ``folder``.

    Raises:
        ValueError: a file's task ids are not exactly ``held_out`` (``where`` names the run).
    """
    prompts: dict[int, dict[str, bool]] = {}
    for path in sorted(folder.glob("prompt-k*.json")):
        fix = "delete it and rerun `scripts/results.py run` to measure that prompt again"
        shape = '{"k": {"task id": true or false}}'
        for k, solved in read_json(path, fix, shape).items():
            if not k.isdigit() or not all(isinstance(v, bool) for v in solved.values()):
                raise ValueError(f"{path} is JSON but not {shape}: {fix}")
            if set(solved) != held_out:
                raise ValueError(
                    f"{path}: its {len(solved)} tasks are not {where}'s {len(held_out)} held-out tasks "
                    f"({len(set(solved) - held_out)} not held out there, {len(held_out - set(solved))} missing); "
                    "were the baseline and the run made from the same config? Delete the file and rerun "
                    "`scripts/results.py run` to measure it again")
            prompts[int(k)] = solved
    return prompts


def best_prompt(prompts: dict[int, dict[str, bool]]) -> int | None:
    """The k with the most successes (the smaller k on a tie); None without prompts.

    >>> best_prompt({0: {"a": False, "b": True}, 3: {"a": True, "b": True}, 5: {"a": True, "b": True}})
    3
    """
    return max(sorted(prompts), key=lambda k: sum(prompts[k].values()), default=None)


@dataclass(frozen=True)
class Outcome:
    """What one run's store says: the version it serves, whether anything was promoted, the base's
    and the served version's held-out results per task, how far it got and what it cost."""

    version: int
    promoted: bool
    base: dict[str, bool]
    served: dict[str, bool]
    progress: RunProgress
    cost: RunCost


def run_outcome(run_dir: Path) -> Outcome:
    """The :class:`Outcome` of one run's store.

    Raises:
        FileNotFoundError: no store in ``run_dir``.
        ValueError: the base was never evaluated, the served version was evaluated on other
            tasks, or a held-out task is among the tasks the run trained on.
    """
    from selfrl.record.store import Store
    from selfrl.report.cost import run_cost
    from selfrl.report.finished import run_progress
    from selfrl.report.run import run_config, served_choice

    db = run_dir / "selfrl.db"
    if not db.exists():
        raise FileNotFoundError(f"no run at {run_dir}: run `scripts/results.py run` first, "
                                "or leave the seed out with --seeds")
    with Store(db, readonly=True) as store:
        config = run_config(run_dir, store)
        choice = served_choice(store, config)
        progress = run_progress(store, config)
        cost = run_cost(store, config)
        promoted = any(v["status"] == "promoted" for v in store.versions())
        version = 0 if choice is None else choice.served
        base, served = store.evaluation(0), store.evaluation(version)
        trained = store.trained_task_ids()
    if not base:
        raise ValueError(f"{run_dir}: the base was never evaluated on the held-out tasks (an unfinished run? "
                         "rerun `scripts/results.py run` to finish it, or leave the seed out with --seeds)")
    if served.keys() != base.keys():
        raise ValueError(f"{run_dir}: version {version} was evaluated on other tasks than the base")
    leaked = sorted(trained & base.keys())
    if leaked:
        raise ValueError(f"{run_dir}: {len(leaked)} held-out tasks were also trained on (e.g. {leaked[0]}): "
                         "its held-out numbers are not held out")
    return Outcome(version, promoted, base, served, progress, cost)


def warm_start_status(cost: RunCost) -> str | None:
    """The warm start's outcome ("promoted", "no_successes", "not yet gated", ...), "not recorded"
    when it is on but recorded nothing (stopped before its sampling ended), None when it is off."""
    ws = cost.warm_start
    if ws is None:
        return None
    return (ws.outcome or "recorded") if ws.recorded else "not recorded"


def table_rows(envs: list[str], seeds: list[int], out: Path) -> list[dict[str, Any]]:
    """One row per environment and seed (see the module docstring for the fields).

    Raises:
        FileNotFoundError, ValueError: from :func:`run_outcome` and :func:`read_prompts`.
    """
    rows = []
    for name in envs:
        env, folder = environment(name), out / name
        ledger = read_ledger(folder)
        for seed in seeds:
            run_dir = folder / f"seed{seed}"
            o = run_outcome(run_dir)
            base, rl, progress, cost, warm = o.base, o.served, o.progress, o.cost, o.cost.warm_start
            prompts = read_prompts(folder, set(base), str(run_dir))
            k = best_prompt(prompts)
            step = ledger.get(f"seed{seed}", {})
            rows.append({
                "environment": name, "config": env.config, "seed": seed, "held_out": len(base),
                "finished": progress.finished, "status": progress.line(),
                "iterations": {"done": progress.done, "of": progress.total},
                "base": rate(base),
                "prompts": {str(s): rate(p) for s, p in sorted(prompts.items())},
                "best_prompt": None if k is None else {"shots": k, **rate(prompts[k])},
                "rl": {"version": o.version, "promoted": o.promoted, **rate(rl)},
                "rl_minus_base": paired(base, rl),
                "rl_minus_best_prompt": None if k is None else paired(prompts[k], rl),
                "rollouts": {"rl": cost.rollouts, "warm_start": None if warm is None else warm.samples},
                "cost_ratio": cost.cost_ratio,
                "cost_s": {"rollout": cost.inference_s, "update": cost.training_s, "validation": cost.validation_s,
                           "warm_start": None if warm is None else warm.seconds},
                "warm_start": warm_start_status(cost),
                "wall_s": {"rl": step.get("wall_s"),
                           "prompts": {s: ledger.get(f"prompt-k{s}", {}).get("wall_s") for s in sorted(prompts)}},
                "commands": {"rl": step.get("command"),
                             "prompts": {s: ledger.get(f"prompt-k{s}", {}).get("command") for s in sorted(prompts)}},
                "code": {"rl": step.get("code", []),
                         "prompts": {s: ledger.get(f"prompt-k{s}", {}).get("code", []) for s in sorted(prompts)}},
            })
            best = rows[-1]["rl_minus_best_prompt"]
            # an unfinished seed has no verdict: its RL is not the run's result yet
            rows[-1]["beats_best_prompt"] = None if best is None or not progress.finished else best["low"] > 0
    return rows


def cell(r: dict[str, Any]) -> str:
    """``"k/n = xx.x % [lo, hi]"`` of a :func:`rate` result."""
    return f"{r['successes']}/{r['n']} = {r['rate']:.1%} [{r['low']:.1%}, {r['high']:.1%}]"


def points(d: dict[str, float] | None) -> str:
    """A paired difference in percentage points with its interval."""
    if d is None:
        return "no prompt measured"
    return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def minutes(s: float | None) -> str:
    return "" if s is None else f"{s / 60:.1f} min"


def seconds(s: float | None) -> str:
    return "" if s is None else f"{s:.1f} s"


def rollouts_cell(r: dict[str, Any]) -> str:
    """The RL rollouts, and the warm start's samples when it is on: ``"96 + 128 warm start"``."""
    rl, warm = r["rollouts"]["rl"], r["rollouts"]["warm_start"]
    if r["warm_start"] is None:
        return str(rl)
    return f"{rl} + {'warm start not recorded' if warm is None else f'{warm} warm start'}"


def ratio_cell(x: float | None) -> str:
    return "no iteration yet" if x is None else f"{x:.2f}"


def warm_start_cell(r: dict[str, Any]) -> str:
    """``"off"``, ``"not recorded"`` or ``"128 samples, 95.0 s (promoted)"``."""
    if r["warm_start"] in (None, "not recorded"):
        return r["warm_start"] or "off"
    return f"{r['rollouts']['warm_start']} samples, {seconds(r['cost_s']['warm_start'])} ({r['warm_start']})"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table, each run's cost, every prompt, then the commands."""
    lines = ["# Results: base, best prompt and RL on the same held-out tasks", "",
             "Greedy held-out success with 95 % Wilson intervals; differences in percentage points with 95 % "
             "intervals, paired on the same held-out tasks. RL is the version the run serves (`gate.rule`); "
             "the best prompt is the k with the most held-out successes, chosen on these same tasks, "
             "which favours the prompt.", "",
             "| environment | seed | held-out | base | best prompt (k) | RL (version) | RL − base | RL − best prompt "
             "| beats the best prompt | RL wall time | rollouts | cost ratio | prompts' wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = r["best_prompt"]
        prompt = "not measured" if best is None else f"{cell(best)} (k = {best['shots']})"
        version = f"v{r['rl']['version']}" if r["rl"]["version"] else \
            "the base, by gate.rule" if r["rl"]["promoted"] else "the base: nothing promoted"
        verdict = {None: "", True: "yes", False: "no"}[r["beats_best_prompt"]] if r["finished"] else r["status"]
        prompt_s = sum(s for s in r["wall_s"]["prompts"].values() if s is not None) or None
        lines.append(f"| {r['environment']} | {r['seed']} | {r['held_out']} | {cell(r['base'])} | {prompt} "
                     f"| {cell(r['rl'])} ({version}) | {points(r['rl_minus_base'])} "
                     f"| {points(r['rl_minus_best_prompt'])} | {verdict} | {minutes(r['wall_s']['rl'])} "
                     f"| {rollouts_cell(r)} | {ratio_cell(r['cost_ratio'])} | {minutes(prompt_s)} |")
    lines.append("")
    for name in dict.fromkeys(r["environment"] for r in rows):
        verdicts = [r["beats_best_prompt"] for r in rows if r["environment"] == name and r["finished"]]
        unfinished = [str(r["seed"]) for r in rows if r["environment"] == name and not r["finished"]]
        left_out = f" ({len(unfinished)} unfinished left out: seed {', '.join(unfinished)})" if unfinished else ""
        if not verdicts:
            lines.append(f"- {name}: no finished seed yet{left_out}.")
        elif None not in verdicts:
            lines.append(f"- {name}: RL beats the best prompt in {sum(verdicts)} of {len(verdicts)} seeds"
                         f"{left_out}.")
    lines += ["", "## Cost", "",
              "Seconds over every session of the run: its iterations' rollouts (inference) and updates "
              "(training), every held-out validation (the base's and the warm start's included), and the "
              "warm start's sampling and fine-tuning. Cost ratio: (rollouts + updates) / rollouts. Rollouts: "
              "the trajectories sampled for RL, then the warm start's samples. The RL wall time above is "
              "the whole `selfrl run`, loading included.", "",
              "| environment | seed | iterations | rollouts | rollouts' time | updates' time | validation time "
              "| warm start | cost ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cost_s"]
        lines.append(f"| {r['environment']} | {r['seed']} | {r['iterations']['done']} | {r['rollouts']['rl']} "
                     f"| {seconds(c['rollout'])} | {seconds(c['update'])} | {seconds(c['validation'])} "
                     f"| {warm_start_cell(r)} | {ratio_cell(r['cost_ratio'])} |")
    lines += ["", "## Every prompt", "", "| environment | k | held-out success |", "|---|---|---|"]
    seen = set()
    for r in rows:
        for k, p in r["prompts"].items():
            if (r["environment"], k) not in seen:
                seen.add((r["environment"], k))
                lines.append(f"| {r['environment']} | {k} | {cell(p)} |")
    lines += ["", "## Commands", "", "```bash"]
    done = set()
    for r in rows:
        for command in [*r["commands"]["prompts"].values(), r["commands"]["rl"]]:
            if command and command not in done:
                done.add(command)
                lines.append(command)
    return "\n".join(lines + ["```", "", *code_lines(rows)])


def code_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The "Code" section: the commit every step ran on, or each step's when they differ (a step
    recorded before commits were, or with no ledger, is "not recorded")."""
    steps: dict[str, list[str]] = {}
    for r in rows:
        for k, code in r["code"]["prompts"].items():
            steps.setdefault(f"{r['environment']} prompt k = {k}", code)
        steps[f"{r['environment']} seed {r['seed']}"] = r["code"]["rl"]
    codes = {tuple(c) for c in steps.values()}
    lines = ["## Code", ""]
    if len(codes) == 1 and len(next(iter(codes))) == 1:
        return lines + [f"Every step ran on commit `{next(iter(codes))[0]}`.", ""]
    return lines + [f"- {step}: {', '.join(f'`{c}`' for c in code) or 'not recorded'}" for step, code in steps.items()] + [""]


def write_table(envs: list[str], seeds: list[int], out: Path) -> Path:
    """Write ``out/results.md`` and ``out/results.json``; the path of the Markdown. Each unfinished
    seed gets a note on stderr."""
    rows = table_rows(envs, seeds, out)
    for r in rows:
        if not r["finished"]:
            print(f"results: note: {r['environment']} seed {r['seed']} is {r['status']}: marked in the table and "
                  "left out of its count; run `scripts/results.py run` to finish it", file=sys.stderr)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    path = out / "results.md"
    path.write_text(markdown(rows))
    return path


# ------------------------------------------------------------------ command line


def seed_value(text: str) -> int:
    """An argparse ``type`` for ``--seeds``: an integer >= 0, as ``selfrl run --seed`` takes (checked
    before the prompts, which take minutes, rather than at the first RL run)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,table}",
                           title="commands (one is required)")
    for name, text in (("run", "run every step not yet finished"), ("table", "write results.md and results.json")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--envs", nargs="+", default=list(ENVIRONMENTS),
                       help=f"environments (default all: {' '.join(ENVIRONMENTS)})")
        s.add_argument("--seeds", type=seed_value, nargs="+", default=[0, 1, 2], help="RL seeds (default 0 1 2)")
        s.add_argument("--out", default="runs/results", help="results folder (default runs/results)")
    a = p.parse_args(argv)
    for flag, values in (("--envs", a.envs), ("--seeds", a.seeds)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # a row per name: a repeated one would count one run twice
            sub.choices[a.command].error(f"{flag} names {', '.join(twice)} more than once; name each once")
    out = Path(a.out).resolve()  # the steps run from the repository root
    try:
        if a.command == "run":
            return run_all(a.envs, a.seeds, out)
        print(f"results: wrote {write_table(a.envs, a.seeds, out)} and {out / 'results.json'}")
        return 0
    except (OSError, ValueError) as e:
        print(f"results: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
