"""The best-prompt baseline: the base model (no adapter) on a run's held-out tasks, with
k worked examples, against what RL reached on the same tasks.

    python scripts/prompt_baseline.py --config configs/function_calling.toml --shots 0 3 5 \
        [--run-dir runs/fc] [--engine auto] [--batch-size 64] [--set rollout.constrain='"none"']

For each ``k`` in ``--shots`` the environment is built with ``options.shots = k`` (the
environment must take a ``shots`` option; ``function_calling``, ``arithmetic``, ``swe`` and
``web`` do) and the base model is evaluated greedily exactly as the gate evaluates
(``selfrl.safety.gate.validate``), on the held-out split of the config (the same tasks as the
run's, by ``task.val_seed``), on the run's engine (``--engine``, default the config's
``engine``: ``auto`` is the slot engine on the CPU) in batches of at most ``--batch-size``
tasks (default the config's ``gate.batch_size``), so memory stays bounded whatever
``gate.val_size`` is. A line on stderr after each batch shows progress. Prints
success with its 95 % Wilson interval; with ``--run-dir``, also the paired difference of
the run's final (latest promoted) version against each prompt on the tasks both were
evaluated on (``selfrl.core.stats.paired_difference_ci``); a run that has not finished
(:mod:`selfrl.report.finished`: still going, interrupted or killed midway) is refused before the
model loads, as its final version is not the run's result yet. A task whose rollout or verdict
failed (a prompt beyond the model's context, say) counts as not solved, as in the gate, and is
said on stderr; when every task failed, nothing was measured and the script fails (exit 2).
Nothing is trained or stored;
``--per-task FILE`` writes ``{k: {task id: solved}}`` as JSON, to pair with a run measured later.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    try:
        return baseline(argv)
    except (OSError, ValueError) as e:  # ConfigError and JSONDecodeError are ValueErrors
        print(f"prompt_baseline: error: {e}", file=sys.stderr)
        return 2


def check_finished(run_dir: Path) -> None:
    """The run in ``run_dir`` (which holds ``selfrl.db``) has finished (:func:`selfrl.report.finished.run_progress`).

    Raises:
        ValueError: it has not, with how far it got (``unfinished: iteration 3 of 10``) and what to do.
    """
    from selfrl.record.store import Store
    from selfrl.report.finished import run_progress
    from selfrl.report.run import run_config

    with Store(run_dir / "selfrl.db", readonly=True) as store:
        progress = run_progress(store, run_config(run_dir, store))
    if not progress.finished:
        raise ValueError(f"run {run_dir} is {progress.line()}: its final version is not the run's result yet; "
                         f"let it finish (selfrl run --resume {run_dir}), or leave out --run-dir and pair the "
                         "prompts with the run later (--per-task)")


def shot_count(text: str) -> int:
    """An argparse ``type`` for ``--shots``: an integer >= 0 (the environment sets the most)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def build_shot_envs(cfg, shots: list[int]) -> list[tuple[int, object, list]]:
    """``(k, environment, held-out tasks)`` for each ``k`` in ``shots``, all built before the model
    loads and before any is evaluated, so that a count the environment refuses (more worked examples
    than it can spare, or any above its most) fails at once.

    Raises:
        ValueError: names the count and the environment's reason.
    """
    from selfrl.envs import get_env

    built = []
    for k in shots:
        try:
            env = get_env(cfg.task.source, **{**cfg.task.options, "shots": k})
            _, val = env.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
        except ValueError as e:
            if "no option 'shots'" in str(e):
                raise ValueError(f"the k-shot baseline needs an environment with a 'shots' option: {e}") from e
            raise ValueError(f"--shots {k}: {cfg.task.source} refuses it: {e}") from e
        built.append((k, env, val))
    return built


def baseline(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True,
                   help="the run's TOML config (selfrl run --config): environment, held-out split, engine")
    p.add_argument("--shots", type=shot_count, nargs="+", default=[0, 3],
                   help="worked examples shown before each task, one evaluation per count (integers >= 0, at "
                        "most what the environment can spare; default: 0 3)")
    p.add_argument("--run-dir", help="a finished selfrl run of the same config: its final version is paired "
                                     "against each prompt on the same held-out tasks")
    p.add_argument("--engine", help="sampling backend: auto | reference | slots (default: the config's engine)")
    p.add_argument("--batch-size", type=int,
                   help="held-out tasks per generation batch (default: the config's gate.batch_size)")
    p.add_argument("--per-task", help="write {shots: {task id: solved}} as JSON to this file")
    p.add_argument("--set", action="append", default=[], help="dotted config override KEY=JSON")
    a = p.parse_args(argv)
    if a.per_task and not Path(a.per_task).absolute().parent.is_dir():
        raise ValueError(f"--per-task {a.per_task}: the folder {Path(a.per_task).absolute().parent} does not exist; "
                         "create it or give a path in an existing folder")
    if a.per_task and Path(a.per_task).is_dir():
        raise ValueError(f"--per-task {a.per_task} is a folder: give a file path")

    from selfrl.core.quiet import silence_library_warnings

    silence_library_warnings()
    import torch

    from selfrl.report.compare import load_outcome
    from selfrl.engines import make_engine
    from selfrl.envs import load_run_config
    from selfrl.safety.gate import validate
    from selfrl.model.load import build_policy
    from selfrl.core.stats import paired_difference_ci, wilson_interval
    from selfrl.core.tools import resolve_tools

    overrides = {}
    for item in a.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item!r}: write KEY=JSON, e.g. rollout.constrain='\"none\"'")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {item!r}: the value is not JSON ({e.msg}); quote strings: '\"none\"'") from e
    if a.engine is not None:
        overrides["engine"] = a.engine
    if a.batch_size is not None:
        overrides["gate.batch_size"] = a.batch_size
    cfg = load_run_config(a.config, overrides)  # checks engine and gate.batch_size as a run would
    if any(k > 0 for k in a.shots) and not cfg.rollout.demonstration:
        raise ValueError("--shots above 0 shows worked examples, and this config sets rollout.demonstration = false "
                         "(no example is shown); drop it or pass --set rollout.demonstration=true")
    shot_envs = build_shot_envs(cfg, a.shots)  # every count checked before the model loads
    run = load_outcome(Path(a.run_dir), "run") if a.run_dir else None  # before the model loads
    if run is not None:
        check_finished(Path(a.run_dir))
    if run is not None and run.final_version is None:
        raise ValueError(f"run {a.run_dir} promoted no version: there is no RL result to compare")
    if run is not None and not run.final:
        raise ValueError(f"run {a.run_dir}'s final version {run.final_version} was never evaluated")
    torch.manual_seed(cfg.seed)
    model, tok = build_policy(cfg)
    engine = make_engine(cfg.engine, model, tok)
    print(f"engine: {getattr(engine, 'name', type(engine).__name__)} (engine = {cfg.engine!r}), "
          f"batches of at most {cfg.gate.batch_size} tasks", flush=True)
    tools = resolve_tools(cfg.rollout.tools)
    if run is not None:
        n = len(run.final)
        lo, hi = wilson_interval(sum(run.final.values()), n)
        print(f"RL run {a.run_dir}: version {run.final_version}: {sum(run.final.values())}/{n} "
              f"= {sum(run.final.values()) / max(n, 1):.1%} [{lo:.1%}, {hi:.1%}]")
    per_task: dict[str, dict[str, bool]] = {}
    for k, env, val in shot_envs:
        t0, done = time.perf_counter(), 0

        def progress(n: int, k: int = k, total: int = len(val)) -> None:
            nonlocal done
            done += n
            print(f"{k}-shot: {done}/{total} tasks, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        res = validate(engine, val, env, tools, cfg.rollout, cfg.gate.batch_size, on_batch=progress,
                       collapse=cfg.collapse)
        failed = ""
        if res.errors:  # counted as not solved, as the gate counts them; said, never hidden
            tid, why = next(iter(res.errors.items()))
            if len(res.errors) >= len(res.results):
                raise ValueError(f"--shots {k}: every held-out task failed ({len(res.errors)} of {len(res.results)}), "
                                 f"e.g. {tid}: {why}; that measures no prompt: lower --shots (or fix what the error "
                                 "names)")
            failed = f"; {len(res.errors)} failed, counted as not solved"
            print(f"{k}-shot: {len(res.errors)} of {len(res.results)} task(s) failed in their environment or verifier "
                  f"(counted as not solved), e.g. {tid}: {why}", file=sys.stderr, flush=True)
        solved = {tid: ok for tid, ok, _ in res.results}
        per_task[str(k)] = solved
        if a.per_task:
            Path(a.per_task).write_text(json.dumps(per_task, indent=1, sort_keys=True))
        s, n = sum(solved.values()), len(solved)
        lo, hi = wilson_interval(s, n)
        line = (f"base model, {k}-shot prompt: {s}/{n} = {s / n:.1%} [{lo:.1%}, {hi:.1%}] "
                f"({time.perf_counter() - t0:.0f} s{failed})")
        if run is not None:
            common = sorted(set(solved) & set(run.final))
            if not common:
                raise ValueError(f"run {a.run_dir} and this config share no held-out task: "
                                 "is it a run of the same environment, options and gate.val_size?")
            d, dlo, dhi = paired_difference_ci([solved[t] for t in common], [run.final[t] for t in common])
            line += f"; RL - this prompt on {len(common)} paired tasks: {d:+.1%} [{dlo:+.1%}, {dhi:+.1%}]"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
