"""The comparison over ``bench_trl.py``'s arms: the held-out success each arm's result reached,
the time to reach each level and TRL's final success, the paired difference against TRL's final
adapter, the figure (``bench_trl.py plot RESULT.json ...``), and the checks on a result file.

Each arm is measured against the TRL arm of its seed that sampled as it did: with selfrl's
grammar (``trl-grammar``) or without (``trl``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, command_line, out_folder, print_table, write_result


def sampled_with_grammar(result: dict) -> bool:
    """Whether an arm's result (its JSON) sampled its training turns under the grammar, from
    its label (results of TRL written before ``--grammar`` existed say ``grammar`` true for a
    TRL arm that sampled freely).

    >>> [sampled_with_grammar({"label": x}) for x in ("selfrl", "selfrl-free-gated", "trl", "trl-grammar")]
    [True, False, False, True]
    """
    label = result["label"]
    return label == "trl-grammar" or (label.startswith("selfrl") and "-free" not in label)


def count_updates(steps: list[dict]) -> int:
    """The steps that changed the weights: a selfrl iteration whose update was skipped (no
    signal, no gradient) is marked ``"skipped"``; every TRL step is an update.

    >>> count_updates([{"skipped": True}, {"skipped": False}, {}])
    2
    """
    return sum(1 for s in steps if not s.get("skipped", False))


def iterations_and_updates(arm: dict) -> tuple[int, int]:
    """An arm's training iterations and the updates among them, from its recorded steps (a
    result written before ``"iterations"`` existed counted iterations as ``"updates"``)."""
    steps = arm.get("train", {}).get("steps")
    if steps is None:
        return arm.get("iterations", arm["updates"]), arm["updates"]
    return len(steps), count_updates(steps)


def rate(per_task: dict[str, bool]) -> float:
    """Share of tasks solved (0.0 for none).

    >>> rate({"a": True, "b": False})
    0.5
    """
    return sum(per_task.values()) / max(len(per_task), 1)


def time_to_reach(curve: list[dict], level: float) -> float | None:
    """Training seconds of the first evaluation with success >= ``level`` (None: never).

    >>> time_to_reach([{"seconds": 0, "success": 0.2}, {"seconds": 60, "success": 0.5}], 0.4)
    60
    """
    return next((c["seconds"] for c in curve if c["success"] >= level - 1e-12), None)


def compare(arms: list[dict], levels: list[float]) -> dict:
    """The table over arms' results: per arm its final success, the seconds to reach each of
    ``levels`` and TRL's final success, the speed-up there (TRL's seconds / the arm's), and
    the paired difference of its final version against TRL's on the held-out tasks both
    were scored on (mean, 95 % low, high; :func:`selfrl.core.stats.paired_difference_ci`).
    ``trl_above_base`` is False where TRL ended no higher than its base: every arm is there at
    0 seconds, so no speed-up is measured (``speedup`` None).

    Raises:
        SystemExit: one arm's result twice (its label and seed), or arms
            scored on different held-out tasks, with different models or evaluation grammars, or
            --tiny beside real runs.
    """
    from selfrl.core.stats import paired_difference_ci

    tasks = {frozenset(a["curve"][0]["results"]) for a in arms}
    if len(tasks) > 1:
        raise SystemExit("the results were scored on different held-out tasks; compare runs of one config "
                         "(and not --tiny runs beside real ones)")
    for key, what in (("model", "models"), ("eval_constrain", "evaluation grammars"), ("tiny", "--tiny and real runs")):
        seen = sorted({str(a.get(key)) for a in arms})
        if len(seen) > 1:
            raise SystemExit(f"the results mix {what} ({', '.join(seen)}); compare arms measured alike")
    twice = sorted({f"{a['label']} (seed {a['seed']})" for a in arms
                    if sum(b["label"] == a["label"] and b["seed"] == a["seed"] for b in arms) > 1})
    if twice:
        raise SystemExit(f"{', '.join(twice)} passed more than once; pass each arm's result once")
    # one TRL result per seed and grammar: its label says which, and no label comes twice
    trl = {(a["seed"], sampled_with_grammar(a)): a for a in arms if a["arm"] == "trl"}
    rows = []
    for a in arms:
        final = a["curve"][-1]
        iterations, updates = iterations_and_updates(a)
        row = {"label": a["label"], "seed": a["seed"], "iterations": iterations, "updates": updates,
               "training_s": a["training_s"],
               "base": a["curve"][0]["success"], "final": final["success"],
               "reach": {str(lv): time_to_reach(a["curve"], lv) for lv in levels}}
        ref = trl_reference(trl, a)
        if ref is not None:
            target = ref["curve"][-1]
            row["trl_label"] = ref["label"]
            row["trl_final"] = target["success"]
            row["trl_final_s"] = time_to_reach(ref["curve"], target["success"])
            row["reach_trl_final_s"] = time_to_reach(a["curve"], target["success"])
            row["speedup"] = (row["trl_final_s"] / row["reach_trl_final_s"]
                              if row["reach_trl_final_s"] and row["trl_final_s"] else None)
            row["trl_above_base"] = target["success"] > ref["curve"][0]["success"]
            shared = sorted(set(final["results"]) & set(target["results"]))
            row["paired_vs_trl"] = paired_difference_ci([target["results"][t] for t in shared],
                                                        [final["results"][t] for t in shared])
        rows.append(row)
    return {"levels": levels, "rows": rows}


def trl_reference(trl: dict[tuple[int, bool], dict], arm: dict) -> dict | None:
    """The TRL result ``arm`` is measured against: TRL's of its seed that sampled as it did
    (with the grammar or without); the seed's only TRL result where there is one; else None.

    >>> refs = {(0, False): {"label": "trl"}, (0, True): {"label": "trl-grammar"}}
    >>> [trl_reference(refs, {"seed": 0, "label": x})["label"] for x in ("selfrl", "selfrl-free")]
    ['trl-grammar', 'trl']
    >>> trl_reference({(0, False): {"label": "trl"}}, {"seed": 0, "label": "selfrl"})["label"]
    'trl'
    """
    same = trl.get((arm["seed"], sampled_with_grammar(arm)))
    if same is not None:
        return same
    seed = [r for (s, _), r in trl.items() if s == arm["seed"]]
    return seed[0] if len(seed) == 1 else None


def draw(arms: list[dict], png: Path) -> None:
    """One line per arm: held-out success (y) against training minutes (x), steps between evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for a in arms:
        xs = [c["seconds"] / 60 for c in a["curve"]]
        ax.step(xs, [c["success"] for c in a["curve"]], where="post", marker="o", markersize=3,
                label=f"{a['label']} (seed {a['seed']})")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel(f"held-out exact match ({len(arms[0]['curve'][0]['results'])} tasks)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    model = "a tiny random model" if arms[0].get("tiny") else arms[0]["model"]
    ax.set_title(f"BFCL simple (<= 3 parameters), {model} + LoRA")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")


ARM_KEYS = ("arm", "label", "seed", "model", "updates", "training_s", "curve")
POINT_KEYS = ("seconds", "step", "success", "results")


def read_arm(path: Path) -> dict:
    """One arm's result file as :func:`run_arm` writes it.

    Raises:
        ValueError: the file cannot be read, is not JSON, or lacks a key of :data:`ARM_KEYS`, a
            non-empty ``curve`` or a key of :data:`POINT_KEYS` in a point (the message names the
            file and what is missing).
    """
    again = "pass the JSON file an arm wrote (benchmarks/results/trl_<label>_seed<S>.json), or run the arm again"
    try:
        arm = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); {again}") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e}); {again}") from None
    if not isinstance(arm, dict):
        raise ValueError(f"{path}: holds a {type(arm).__name__}, not an arm's result; {again}")
    missing = [k for k in ARM_KEYS if k not in arm]
    if missing:
        raise ValueError(f"{path}: not an arm's result of bench_trl.py (no {', '.join(map(repr, missing))}); {again}")
    curve = arm["curve"]
    if not isinstance(curve, list) or not curve or not all(isinstance(c, dict) for c in curve):
        raise ValueError(f"{path}: its 'curve' is not a non-empty list of points; {again}")
    for i, c in enumerate(curve):
        lacking = [k for k in POINT_KEYS if k not in c]
        if lacking:
            raise ValueError(f"{path}: point {i} of its 'curve' has no {', '.join(map(repr, lacking))}; {again}")
    return arm


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_trl.py plot", description="Draw and tabulate arms' results.")
    p.add_argument("results", nargs="+", type=Path, help="arms' JSON files (benchmarks/results/trl_*.json)")
    p.add_argument("--png", type=Path, default=RESULTS / "trl_curve.png", help="the figure (PNG)")
    p.add_argument("--levels", default="0.3,0.4,0.5", help="held-out success levels to time, comma-separated")
    p.add_argument("--out", type=out_folder, default=None,
                   help="folder for trl_compare.json (default benchmarks/results)")
    return p


def plot(argv: list[str]) -> dict:
    """``bench_trl.py plot RESULT.json ...``: the figure and the table over arms' results.

    Raises:
        SystemExit: 2 (argparse's usage error, on stderr) for a missing or malformed result file
            or bad ``--levels``; the message names the file and what to pass instead.
    """
    p = plot_parser()
    args = p.parse_args(argv)
    missing = [str(r) for r in args.results if not r.is_file()]
    if missing:
        p.error(f"no such result file: {', '.join(missing)}; run an arm first (bench_trl.py --arm trl|selfrl), "
                "then pass the JSON file it wrote")
    try:
        levels = [float(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or not all(0 <= lv <= 1 for lv in levels):
        p.error(f"--levels takes numbers in [0, 1] separated by commas, got {args.levels!r}")
    try:
        arms = [read_arm(r) for r in args.results]
    except ValueError as e:
        p.error(str(e))
    table = compare(arms, levels)
    draw(arms, args.png)

    def sec(x):
        return "never" if x is None else f"{x:.0f}"

    rows = []
    for r in table["rows"]:
        ci = r.get("paired_vs_trl")
        rows.append([f"{r['label']} (seed {r['seed']})", r["iterations"], r["updates"], f"{r['training_s']:.0f}",
                     f"{r['base']:.3f}", f"{r['final']:.3f}", *[sec(r["reach"][str(lv)]) for lv in levels],
                     r.get("trl_label", "-"), sec(r["reach_trl_final_s"]) if "trl_label" in r else "-",
                     "-" if r.get("speedup") is None else f"{r['speedup']:.2f}",
                     "-" if ci is None else f"{ci[0]:+.3f} [{ci[1]:+.3f}, {ci[2]:+.3f}]"])
    print_table("Held-out success against training time (seconds)",
                ["arm", "iterations", "updates", "training s", "base", "final", *[f"s to {lv:g}" for lv in levels],
                 "against", "s to TRL's final", "speed-up", "final - TRL's final [95 % CI]"], rows)
    alone = sorted({(r["seed"], r["label"]) for a, r in zip(arms, table["rows"])
                    if a["arm"] != "trl" and "trl_label" not in r})
    for seed, label in alone:  # "never" read as "never reached TRL's final", against no TRL arm at all
        print(f"seed {seed}: {label} has no TRL arm of its seed among the files, so it is compared with none; pass "
              f"the TRL arm's result of seed {seed} too (bench_trl.py --arm trl [--grammar] --seed {seed})")
    flat = {(r["seed"], r["trl_label"]) for r in table["rows"] if r.get("trl_above_base") is False}
    for seed, label in sorted(flat):
        print(f"seed {seed}: {label} ended at its base's held-out success, where every arm starts: there is no "
              "speed-up to measure against it; compare the finals (the last column) or train TRL longer (--minutes)")
    result = {"command": command_line("bench_trl.py", ["plot", *map(str, args.results), "--levels", args.levels,
                                                      "--png", str(args.png)]),
              "files": [str(r) for r in args.results], "png": str(args.png), **table}
    print(f"wrote {args.png} and {write_result('trl_compare', result, args.out)}")
    return result
