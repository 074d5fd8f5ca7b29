"""Learning from a judge against learning from the verifier: the same run once per arm and seed,
rewarded by the LLM judge (``configs/judge.toml``), by the task's verifier
(``configs/judge_verifier.toml``, which differs only in the reward) and, on request
(``--arms``), by the judge without calibration (``configs/judge_uncalibrated.toml``); then the
held-out success of each side by side. The held-out gate uses the verifier in every arm, on the
same held-out tasks (``task.val_seed``), disjoint from the training tasks.

    # runs the judge and verifier arms for each seed (starting the judge server if nothing answers at the judge's
    # base_url), then prints the table; a run folder that already holds a finished run is kept, an unfinished one
    # (interrupted or killed midway) is resumed
    PYTHONPATH=$PWD python scripts/judge_vs_verifier.py run --seeds 0 1 2 3 4 --out runs/judge-vs-verifier
    # a third arm: the judge without calibration (configs/judge_uncalibrated.toml)
    PYTHONPATH=$PWD python scripts/judge_vs_verifier.py run --seeds 0 1 2 3 4 --arms judge-uncalibrated --out runs/judge-vs-verifier
    # the table alone, from the run folders
    PYTHONPATH=$PWD python scripts/judge_vs_verifier.py table --out runs/judge-vs-verifier

The judge is the endpoint of ``configs/judge.toml`` (``http://127.0.0.1:8231/v1``): this script
starts ``selfrl serve --no-learn --port 8231 --run-dir OUT/judge-server`` for it when needed,
and stops it at the end. ``--iterations`` and ``--val-size`` apply to every arm alike (the docs' table uses the configs' own).

Per seed the table gives each arm's base and final held-out success (final: the version the
run serves at its end, its latest promoted version or the base) with the 95 % Wilson interval,
its updates, the last candidate the gate evaluated (promoted or rejected), the share of the judge's verdicts that reached the update
(the rest were held back by calibration or failed), the share of rollouts that called the
calculator in the last iteration, and the paired difference judge - verifier of the two final
versions on the held-out tasks both were evaluated on (normal approximation on per-task
differences, :func:`selfrl.core.stats.paired_difference_ci`). The last row pools the seeds'
per-task pairs (it treats them as independent, which tasks shared across seeds are not). A last
table gives, per judge arm, the judge's mean score for the training rollouts the verifier finds
right and for those it finds wrong.

A run that has not finished (fewer updates than its ``iterations``, or its last candidate not yet
gated: :mod:`selfrl.report.finished`; an interrupted run writes ``report.md`` too) is left out of
every table, and a line under the first table names it with how far it got.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"verifier": ROOT / "configs" / "judge_verifier.toml", "judge": ROOT / "configs" / "judge.toml",
        "judge-uncalibrated": ROOT / "configs" / "judge_uncalibrated.toml"}
DEFAULT_ARMS = ["verifier", "judge"]


def judge_url() -> str:
    """The judge endpoint's base URL in ``configs/judge.toml``."""
    return tomllib.loads(ARMS["judge"].read_text())["judge"]["endpoints"][0]["base_url"]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def start_judge(out: Path, wait_s: float = 600.0) -> subprocess.Popen | None:
    """Start ``selfrl serve --no-learn`` on the judge's port unless something answers there;
    returns the process (None when one was running already).

    Raises:
        RuntimeError: the server exits, or does not answer within ``wait_s`` seconds.
    """
    url = judge_url()
    if answers(url):
        print(f"judge: using the server already answering at {url}", flush=True)
        return None
    port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    log = open(out / "judge-server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--no-learn", "--port", port,
                             "--run-dir", str(out / "judge-server")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + wait_s
    while not answers(url):
        if proc.poll() is not None:
            raise RuntimeError(f"the judge server exited with {proc.returncode}; see {out / 'judge-server.log'}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the judge server did not answer at {url} within {wait_s:.0f} s")
        time.sleep(2)
    print(f"judge: started selfrl serve --no-learn at {url} (pid {proc.pid})", flush=True)
    return proc


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}-s{seed}"


def progress_line(folder: Path) -> str | None:
    """``"finished"``, ``"unfinished: iteration 3 of 10"``, ... of the run in ``folder``; None without one."""
    from selfrl.record.store import Store
    from selfrl.report.finished import run_progress
    from selfrl.report.run import run_config

    if not (folder / "selfrl.db").exists():
        return None
    with Store(folder / "selfrl.db", readonly=True) as store:
        progress = run_progress(store, run_config(folder, store))
    return "finished" if progress.finished else progress.line()


def run_arms(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    judge = start_judge(out) if any(arm != "verifier" for arm in a.arms) else None
    try:
        for seed in a.seeds:
            for arm in a.arms:
                folder = run_dir(out, arm, seed)
                state = progress_line(folder)
                if state == "finished":
                    print(f"{folder}: finished already, kept", flush=True)
                    continue
                if state is not None:  # interrupted or killed midway: go on where it stopped
                    print(f"{folder}: {state}, resumed", flush=True)
                    cmd = [sys.executable, "-m", "selfrl.cli", "run", "--resume", str(folder)]
                else:
                    cmd = [sys.executable, "-m", "selfrl.cli", "run", "--config", str(ARMS[arm]), "--seed", str(seed),
                           "--run-dir", str(folder)]
                    cmd += [] if a.iterations is None else ["--iterations", str(a.iterations)]
                    cmd += [] if a.val_size is None else ["--val-size", str(a.val_size)]
                print("$ " + " ".join(cmd), flush=True)
                started = time.monotonic()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if a.quiet else None)
                print(f"{folder}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if judge is not None:
            judge.terminate()
            judge.wait(60)
    print_table(out, a.seeds)


def cell(results: dict[str, bool]) -> str:
    from selfrl.core.stats import wilson_interval

    k, n = sum(results.values()), len(results)
    low, high = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.3f} [{low:.2f}, {high:.2f}]" if n else "not evaluated"


def updates(folder: Path) -> tuple[int, int, str, str, float]:
    """``(updates trained, iterations, last gated candidate, verdicts used, tool use)`` of one run.

    An iteration's update was trained when its metrics row says ``skipped = 0`` (an update with
    no scored group, e.g. every group held back by the judge's calibration, is skipped). Verdicts
    used: the judge's scored trajectories out of those it was asked about (``judge/scored`` and
    ``judge/failed`` summed), "-" without a judge. Tool use: ``train/tool_use`` of the last iteration.
    Last gated candidate: the highest version the gate evaluated, its status and held-out successes.
    """
    from selfrl.record.store import Store

    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    scored = sum(r.get("judge/scored", 0) for r in rows)
    asked = scored + sum(r.get("judge/failed", 0) for r in rows)
    tool_use = [r["train/tool_use"] for r in rows if "train/tool_use" in r]
    with Store(folder / "selfrl.db", readonly=True) as store:
        gated = [(v["version"], v["status"], store.evaluation(v["version"])) for v in store.versions() if v["version"]]
    gated = [g for g in gated if g[2]]  # versions the gate evaluated
    last = "none" if not gated else f"v{gated[-1][0]} {gated[-1][1]}, {sum(gated[-1][2].values())}/{len(gated[-1][2])}"
    used = f"{scored:.0f} of {asked:.0f}" if asked else "-"
    return sum(1 for x in skipped if not x), len(skipped), last, used, tool_use[-1] if tool_use else float("nan")


def print_table(out: Path, seeds: list[int] | None) -> None:
    """Print the two tables (per seed and arm; judge arms against the verifier arm, paired) from
    the run folders ``OUT/<arm>-s<seed>``; an arm without a finished run for a seed is left out
    (an unfinished one is named under the first table)."""
    from selfrl.report.compare import load_outcome
    from selfrl.core.stats import paired_difference_ci

    if not seeds:
        seeds = sorted({int(p.name.rsplit("-s", 1)[1]) for p in out.glob("*-s*") if (p / "selfrl.db").exists()})
    print("| seed | arm | base held-out, 95% Wilson CI | final held-out, 95% Wilson CI | final version "
          "| updates trained | last gated candidate | judge verdicts used | tool use (last iteration) | wall-clock |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    finals: dict[str, dict[int, dict[str, bool]]] = {arm: {} for arm in ARMS}
    unfinished = []
    for seed in seeds:
        for arm in ARMS:
            folder = run_dir(out, arm, seed)
            state = progress_line(folder)
            if state != "finished":  # not run, or not finished (an interrupted run writes report.md too)
                if state is not None:
                    unfinished.append(f"{folder.name} ({state})")
                continue
            o = load_outcome(folder, arm)
            final = o.final or o.base
            trained, iterations, gated, used, tool_use = updates(folder)
            print(f"| {seed} | {arm} | {cell(o.base)} | {cell(final)} | {o.final_version} | {trained} of {iterations} "
                  f"| {gated} | {used} | {tool_use:.2f} | {o.timeline.elapsed_s:.0f} s |")
            finals[arm][seed] = final
    if unfinished:
        print(f"\nLeft out, not finished: {', '.join(unfinished)}; `run` with the same --seeds resumes them.")
    print()
    print("| seed | arm | shared held-out tasks | arm - verifier (final versions), paired, 95% CI |")
    print("|---|---|---|---|")
    for arm in (a for a in ARMS if a != "verifier"):
        ver_all: list[bool] = []
        arm_all: list[bool] = []
        paired_seeds = [s for s in seeds if s in finals[arm] and s in finals["verifier"]]
        for seed in paired_seeds:
            ver, other = finals["verifier"][seed], finals[arm][seed]
            shared = sorted(ver.keys() & other.keys())
            ver_all += [ver[t] for t in shared]
            arm_all += [other[t] for t in shared]
            diff, low, high = paired_difference_ci([ver[t] for t in shared], [other[t] for t in shared])
            print(f"| {seed} | {arm} | {len(shared)} | {diff:+.3f} [{low:+.3f}, {high:+.3f}] |")
        if len(paired_seeds) > 1:
            diff, low, high = paired_difference_ci(ver_all, arm_all)
            print(f"| all ({len(paired_seeds)} seeds pooled) | {arm} | {len(ver_all)} | {diff:+.3f} [{low:+.3f}, {high:+.3f}] |")
    print()
    print("| arm | training rollouts the judge scored | mean judge score: right answers (n) | wrong answers (n) |")
    print("|---|---|---|---|")
    for arm in (a for a in ARMS if a != "verifier"):
        right, wrong = judge_scores([run_dir(out, arm, seed) for seed in seeds if seed in finals[arm]])
        if right or wrong:
            print(f"| {arm} | {len(right) + len(wrong)} | {mean(right)} ({len(right)}) | {mean(wrong)} ({len(wrong)}) |")


def mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


def judge_scores(folders: list[Path]) -> tuple[list[float], list[float]]:
    """The judge's score (``rewards["judge"]``, in [0, 1]) of every stored training rollout it
    scored in ``folders``, split by the verifier's verdict (``correct``, which the learner never saw)."""
    from selfrl.record.store import Store

    right: list[float] = []
    wrong: list[float] = []
    for folder in folders:
        with Store(folder / "selfrl.db", readonly=True) as store:
            for t in store.trajectories():
                score = t.rewards.get("judge")
                if score is not None and t.correct is not None:
                    (right if t.correct else wrong).append(score)
    return right, wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run each arm of --arms for each seed, then print the table")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    r.add_argument("--out", default="runs/judge-vs-verifier", help="folder of the run folders <arm>-s<seed>")
    r.add_argument("--arms", nargs="+", choices=list(ARMS), default=DEFAULT_ARMS,
                   help="the arms to run (default: verifier judge); judge-uncalibrated: configs/judge_uncalibrated.toml, the judge without calibration")
    r.add_argument("--iterations", type=int, help="iterations of every arm (default: the configs')")
    r.add_argument("--val-size", type=int, help="held-out tasks of every arm (default: the configs')")
    r.add_argument("--quiet", action="store_true", help="hide the runs' progress output")
    t = sub.add_parser("table", help="print the table from the run folders")
    t.add_argument("--out", default="runs/judge-vs-verifier")
    t.add_argument("--seeds", type=int, nargs="*")
    a = p.parse_args()
    if a.command == "run":
        run_arms(a)
    else:
        print_table(Path(a.out), a.seeds)


if __name__ == "__main__":
    main()
