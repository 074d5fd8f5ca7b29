"""``selfrl compare RUN_DIR...``: several runs side by side.

Writes ``compare.md`` with two overview figures (:func:`selfrl.report.figures.overview_figure`,
one colour per run): against rollouts generated and against wall-clock time. Below
them, a table of each run's final held-out result with its 95 % Wilson interval, and
the paired difference of each run against the first on the held-out tasks both final
versions were evaluated on (:func:`selfrl.core.stats.paired_difference_ci`). Pairing on the
same tasks removes the between-task variance, so the interval is the one to read when
the runs share their held-out set (same task source and ``task.val_seed``).

"Final" is the version a run serves: its latest promoted version, else the base.
Any run recorded in a selfrl store can be compared: two learning rates, two reward
presets, a baseline, or another trainer's run written in the same format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrl.report.figures import overview_figure, save
from selfrl.report.run import run_config, served_choice
from selfrl.core.stats import paired_difference_ci, wilson_interval
from selfrl.record.rundir import check_folder
from selfrl.record.store import Store
from selfrl.report.timeline import Timeline, duration, load_timeline


@dataclass
class RunOutcome:
    """One compared run: its timeline, the per-task held-out results of its final version, its config."""

    label: str
    run_dir: Path
    timeline: Timeline
    final_version: int | None  # the version it serves (gate.rule); None when it promoted none
    final: dict[str, bool]  # task id -> solved
    base: dict[str, bool]
    config: dict[str, Any]


def load_outcome(run_dir: Path, label: str) -> RunOutcome:
    """Read one run (read-only).

    Raises:
        FileNotFoundError: no ``selfrl.db`` in ``run_dir``.
    """
    db = Path(run_dir) / "selfrl.db"
    if not db.exists():
        raise FileNotFoundError(f"no run at {run_dir}: {db} does not exist")
    with Store(db, readonly=True) as store:
        timeline = load_timeline(store, label)
        config = run_config(Path(run_dir), store)
        choice = served_choice(store, config)  # by the run's gate.rule
        version = None if store.latest_promoted() is None or choice is None else choice.served
        return RunOutcome(label, Path(run_dir), timeline, version,
                          {} if version is None else store.evaluation(version), store.evaluation(0), config)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"beta": 0.02}}`` -> ``{"train.beta": 0.02}``.

    >>> flatten({"train": {"beta": 0.02}, "iterations": 4})
    {'train.beta': 0.02, 'iterations': 4}
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings_table(outcomes: list[RunOutcome]) -> list[str]:
    """The config keys whose values differ between the runs (``run_dir`` left out)."""
    flat = [flatten(o.config) for o in outcomes]
    keys = sorted({k for f in flat for k in f} - {"run_dir"})
    differ = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    if not differ:
        return ["The runs' configs do not differ (apart from their folders).", ""]
    lines = ["| setting | " + " | ".join(o.label for o in outcomes) + " |", "|---" * (len(outcomes) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(str(f.get(k, "")) for f in flat) + " |" for k in differ]
    return lines + [""]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Folder names, or whole paths where two folders share a name."""
    names = [Path(d).name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def rate_cell(results: dict[str, bool]) -> str:
    """``"k/n = 0.xxx [low, high]"``, or "not evaluated"."""
    if not results:
        return "not evaluated"
    k, n = sum(results.values()), len(results)
    low, high = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.3f} [{low:.3f}, {high:.3f}]"


def results_table(outcomes: list[RunOutcome]) -> list[str]:
    """One row per run: final version, held-out success with its interval, base, cost."""
    lines = ["| run | final version | held-out success, 95% Wilson CI | base | updates | rollouts | wall-clock |",
             "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        t = o.timeline
        lines.append(f"| {o.label} | {'' if o.final_version is None else o.final_version} | {rate_cell(o.final)} "
                     f"| {rate_cell(o.base)} | {t.updates} | {t.rollouts} | {duration(t.elapsed_s)} |")
    return lines + [""]


def paired_table(outcomes: list[RunOutcome]) -> list[str]:
    """Each run against the first: mean per-task difference on the shared held-out tasks."""
    ref = outcomes[0]
    lines = [f"Paired difference against **{ref.label}** on the held-out tasks both final versions were "
             "evaluated on (normal approximation on per-task differences):", "",
             "| run | shared tasks | difference (run - reference), 95% CI |", "|---|---|---|"]
    for o in outcomes[1:]:
        shared = sorted(ref.final.keys() & o.final.keys())
        if not shared:
            lines.append(f"| {o.label} | 0 | no shared held-out task |")
            continue
        diff, low, high = paired_difference_ci([ref.final[t] for t in shared], [o.final[t] for t in shared])
        lines.append(f"| {o.label} | {len(shared)} | {diff:+.3f} [{low:+.3f}, {high:+.3f}] |")
    return lines + [""]


def compare_runs(run_dirs: list[Path], out: Path) -> Path:
    """Write ``out/compare.md`` and its figures ``out/compare_rollouts.png`` and
    ``out/compare_wallclock.png``.

    Args:
        run_dirs: two or more run folders (each holding ``selfrl.db``); the first is
            the reference of the paired differences.
        out: output folder (created if missing).

    Returns:
        The path of ``compare.md``.

    Raises:
        ValueError: fewer than two runs.
        FileNotFoundError: a folder holds no run.
    """
    if len(run_dirs) < 2:
        raise ValueError(f"compare needs at least two run folders, got {len(run_dirs)}")
    check_folder(out)  # before any run is read
    outcomes = [load_outcome(Path(d), label) for d, label in zip(run_dirs, run_labels(run_dirs))]
    timelines = [o.timeline for o in outcomes]
    out = Path(out)
    title = " vs ".join(o.label for o in outcomes)
    save(overview_figure(timelines, "rollouts", f"{title}: against rollouts"), out / "compare_rollouts.png")
    save(overview_figure(timelines, "elapsed", f"{title}: against wall-clock time"), out / "compare_wallclock.png")
    lines = [f"# selfrl compare: {title}", "", "| run | folder |", "|---|---|"]
    lines += [f"| {o.label} | {o.run_dir} |" for o in outcomes]
    lines += ["", "## Settings that differ", ""] + settings_table(outcomes)
    lines += ["## Final held-out results", ""] + results_table(outcomes) + paired_table(outcomes)
    lines += ["## Against rollouts", "", "![against rollouts](compare_rollouts.png)", "",
              "## Against wall-clock time", "", "![against wall-clock time](compare_wallclock.png)", ""]
    path = out / "compare.md"
    path.write_text("\n".join(lines))
    return path
