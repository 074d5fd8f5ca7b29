"""Fault-injection suite: poison, destroy and kill a tiny ``selfrl run``, then check that it recovered.

    .venv/bin/python scripts/fault_suite.py [--out runs/fault_suite.json] [--keep DIR]

Every fault runs ``selfrl run`` as a subprocess (``python scripts/fault_suite.py child ...``,
which registers the test reward ``short`` and calls ``selfrl.cli.main``) on a tiny
random Phi saved to a temporary folder, with ``SELFRL_FAULT`` set (see ``selfrl/faults.py``):

* ``lr_x1000@1``, ``noise@1``: a destructive update at iteration 1; recovered when a
  ``collapse`` event rolled that version back within one validation cycle and it is
  never served.
* ``nan_loss@1``: recovered when iteration 1's update was skipped as not finite and
  made no version.
* ``kill:<point>@1`` for every point of ``selfrl.faults.POINTS``: the process must die
  by SIGKILL; then ``--resume`` must finish the run; recovered when every trajectory
  stored before the kill is still there, byte for byte, and every version marked
  served (promoted or base) is complete (``adapters.verify_version``).

Distributed faults (``selfrl run --ray local``, 2 rollout workers; only when Ray is installed):

* ``worker:kill:<point>`` for each point of ``selfrl.distributed.worker.WORKER_FAULT_POINTS``
  (``before_sampling``, ``mid_rollout``, ``after_sending``): the first worker to reach the
  point SIGKILLs itself (``SELFRL_WORKER_FAULT``); ``worker:stop:mid_rollout`` SIGSTOPs it
  instead (alive and silent, as a worker partitioned from the driver), and the driver
  must time it out (``job_timeout_s``, 4 s; this run has one worker, so it cannot finish
  without) and replace it. Recovered when the run finishes
  with exactly one ``worker_lost``, every iteration trained ``num_prompts`` whole groups
  (trajectories lost: the groups missing), no group stored twice, every trained group
  within the staleness bound, and no corrupt version served.
* ``ray:kill:<point>@1``: the *driver* of a distributed run is SIGKILLed at a point of
  ``selfrl.faults.POINTS``, then ``--resume`` (with ``--ray``) must finish the run from
  the last good version: every trajectory stored before the kill unchanged, no group id
  stored twice, the ``resume`` event naming the version that was the newest servable one
  at the kill, and no corrupt version served.

It prints a table (faults injected, recovered, trajectories lost, corrupt versions
served) and writes the rows as JSON. ``tests/test_faults.py`` and
``tests/test_distributed.py`` run the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
ITERATIONS = 3
FAULT_ITERATION = 1


def short(traj, ctx):
    """Test reward: 1 for an immediate EOS, 0 at the token limit of both turns (2 x 12 tokens).
    A random model never answers correctly; this one differs within groups, so updates happen."""
    return 1.0 - traj.num_completion_tokens / 24


# ------------------------------------------------------------------------- setup


def save_tiny_model(path: Path, seed: int = 0, eos_bias: float = 2.0) -> Path:
    """The tests' tiny Phi (``selfrl.testing``), saved as a local model folder."""
    from selfrl.testing import build_tiny_tokenizer, save_tiny_phi

    return save_tiny_phi(path, build_tiny_tokenizer(), seed, eos_bias)


CONFIG = """\
iterations = {iterations}
num_prompts = 2
num_generations = 4
reward_weights = {{ short = 1.0 }}
[model]
name = "{model}"
[lora]
r = 4
[task]
num_train = 40
[rollout]
max_new_tokens = 12
max_turns = 2
temperature = 0.7
[train]
learning_rate = 1e-3
beta = 0.05
micro_batch_size = 8
[gate]
val_size = 6
eval_every = 1
[collapse]
degenerate_rise = 0.6
"""
# degenerate_rise: the tiny random model's share of degenerate rollouts swings between 0.5 and
# 1.0 from one batch of 8 to the next, so the suite leaves that rule to the unit tests
# (tests/test_collapse.py); the destructive faults are caught by the KL rule.


DIST_CONFIG = CONFIG + """\
[distributed]
address = "local"
num_workers = {num_workers}
max_staleness = 1
worker_cpus = 0.5
job_timeout_s = {job_timeout_s}
"""
# job_timeout_s: a tiny model's job takes well under a second, even on 2 shared cores. The
# partition fault (a SIGSTOPped worker) runs with one worker and a 4 s timeout, so the run can
# only go on once the driver has timed the silent worker out and replaced it (with two, the
# other worker may finish the run first); every other fault gets 60 s, never reached.
PARTITION_TIMEOUT_S = 4.0


def write_config(path: Path, model_dir: Path, iterations: int = ITERATIONS, distributed: bool = False,
                 job_timeout_s: float = 60.0, num_workers: int = 2) -> Path:
    text = DIST_CONFIG if distributed else CONFIG
    path.write_text(text.format(iterations=iterations, model=model_dir, job_timeout_s=job_timeout_s,
                                num_workers=num_workers))
    return path


def run_child(args: list[str], fault: str | None = None, timeout: float = 300,
              worker_fault: str | None = None) -> subprocess.CompletedProcess:
    """``selfrl run <args>`` in a subprocess, with ``SELFRL_FAULT=fault`` (the driver's) and
    ``SELFRL_WORKER_FAULT=worker_fault`` (a Ray rollout worker's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RAY_memory_monitor_refresh_ms": "0"}  # Ray must not kill workers for others' memory use
    env.pop("SELFRL_FAULT", None)
    env.pop("SELFRL_WORKER_FAULT", None)
    if fault:
        env["SELFRL_FAULT"] = fault
    if worker_fault:
        env["SELFRL_WORKER_FAULT"] = worker_fault
    return subprocess.run([sys.executable, str(SCRIPT), "child", "run", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


# ----------------------------------------------------------------------- checks


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every stored trajectory, ``{id: data_json}`` (the exact stored text)."""
    db = run_dir / "selfrl.db"
    if not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT id, data_json FROM trajectories"))
    finally:
        conn.close()


def read_run(run_dir: Path) -> dict:
    """Versions, events and per-step metrics of a finished run (read with ``selfrl.store.Store``)."""
    from selfrl.store import Store

    with Store(run_dir / "selfrl.db") as store:
        metrics: dict[int, dict[str, float]] = {}
        for m in store.metrics():
            metrics.setdefault(m["step"], {})[m["name"]] = m["value"]
        return {"versions": store.versions(), "events": store.events(), "metrics": metrics}


def corrupt_served(run_dir: Path, versions: list[dict], final: int | None) -> list[int]:
    """Versions marked served (promoted or base) whose folder is not complete, plus the
    run's final served version ``final`` when its folder does not load with matching checksums."""
    from selfrl import adapters

    bad = [v["version"] for v in versions
           if v["status"] in ("promoted", "base") and adapters.verify_version(Path(v["path"])) is not None]
    if final is not None:
        try:
            adapters.load_version_state(adapters.version_dir(run_dir, final))  # verifies the checksums first
        except (adapters.CorruptVersionError, FileNotFoundError):
            bad.append(final)
    return sorted(set(bad))


def final_version(stdout: str) -> int | None:
    """The served version from ``selfrl run``'s last lines ("... (version N)"), or None."""
    m = re.search(r"\(version (\d+)\)\s*\nreport:", stdout)
    return int(m.group(1)) if m else None


@dataclass
class Outcome:
    """One injected fault and what became of it."""

    fault: str
    recovered: bool
    trajectories_lost: int = 0
    corrupt_versions_served: int = 0
    seconds: float = 0.0
    detail: str = ""
    notes: list[str] = field(default_factory=list)


def check_corrupting(fault: str, run_dir: Path, final: int | None) -> Outcome:
    """Judge a finished ``lr_x1000``, ``noise`` or ``nan_loss`` run whose served version is
    ``final`` (see the module docstring)."""
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    step = r["metrics"].get(FAULT_ITERATION, {})
    if fault.startswith("nan_loss"):
        ok = step.get("skip_reason_not_finite") == 1.0 and step.get("version") == step.get("sampled_version")
        return Outcome(fault, ok and not bad, corrupt_versions_served=len(bad),
                       detail="update skipped as not finite" if ok else f"iteration metrics {step}")
    made = int(step.get("version", -1))
    if made == int(step.get("sampled_version", -1)):
        return Outcome(fault, False, detail="the faulty update made no version")
    status = {v["version"]: v["status"] for v in r["versions"]}
    hits = [e for e in r["events"] if e["kind"] == "collapse" and made in e["data"].get("rolled_back", [])]
    cycle = 1  # gate.eval_every in CONFIG
    in_time = bool(hits) and hits[0]["data"]["iteration"] <= FAULT_ITERATION + cycle
    served = status.get(made) == "promoted" or final == made
    ok = in_time and not served and not bad
    rules = sorted({a["rule"] for e in hits for a in e["data"]["alarms"]})
    detail = (f"version {made} rolled back at iteration {hits[0]['data']['iteration']} by {', '.join(rules)}"
              if hits else f"version {made} not rolled back (status {status.get(made)})")
    return Outcome(fault, ok, corrupt_versions_served=len(bad), detail=detail)


def check_kill(fault: str, run_dir: Path, before: dict[str, str], final: int | None) -> Outcome:
    """Judge a run killed (with ``before`` stored then) and resumed to the end, serving
    ``final`` (see the module docstring)."""
    after = snapshot(run_dir)
    lost = sum(1 for k, v in before.items() if after.get(k) != v)
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    done = sorted(s for s, m in r["metrics"].items() if "reward/mean" in m)
    finished = done == list(range(ITERATIONS))
    recovered = [e["message"] for e in r["events"] if e["kind"] in ("recover", "corrupt_version")]
    ok = lost == 0 and not bad and finished
    detail = (f"{len(before)} trajectories before the kill, {len(after)} after resume; iterations {done}"
              + (f"; {len(recovered)} recovery events" if recovered else ""))
    return Outcome(fault, ok, lost, len(bad), detail=detail, notes=recovered)


def run_fault(fault: str, model_dir: Path, work: Path) -> Outcome:
    """Inject one fault into a fresh run under ``work``; returns its :class:`Outcome`."""
    t0 = time.perf_counter()
    run_dir = work / fault.replace(":", "_").replace("@", "_at_")
    config = write_config(work / f"{run_dir.name}.toml", model_dir)
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    if fault.startswith("kill:"):
        killed = run_child(args, fault)
        if killed.returncode != -signal.SIGKILL:
            return Outcome(fault, False, detail=f"not killed: exit {killed.returncode}: {killed.stderr[-400:]}")
        before = snapshot(run_dir)
        proc = run_child(["--config", str(config), "--resume", str(run_dir)])
    else:
        before, proc = {}, run_child(args, fault)
    if proc.returncode != 0:
        out = Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}")
    elif fault.startswith("kill:"):
        out = check_kill(fault, run_dir, before, final_version(proc.stdout))
    else:
        out = check_corrupting(fault, run_dir, final_version(proc.stdout))
    out.seconds = time.perf_counter() - t0
    return out


# ------------------------------------------------------------- distributed faults

NUM_PROMPTS, NUM_GENERATIONS = 2, 4  # as CONFIG


def groups_check(run_dir: Path) -> tuple[int, int, list[int]]:
    """``(trajectories lost, groups stored twice, staleness of every stored trajectory)`` of a
    finished distributed run: lost are the trajectories missing from iterations that trained
    fewer than ``num_prompts`` whole groups; a group id stored with more than ``num_generations``
    trajectories is stored twice; staleness is ``learner version - sampler version``."""
    db = sqlite3.connect(f"file:{run_dir / 'selfrl.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT iteration, group_id, adapter_version FROM trajectories").fetchall()
        learner = dict(db.execute("SELECT step, value FROM metrics WHERE name = 'sampled_version'").fetchall())
    finally:
        db.close()
    per_group: dict[str, int] = {}
    per_iteration: dict[int, int] = {}
    for it, gid, _ in rows:
        per_group[gid] = per_group.get(gid, 0) + 1
        per_iteration[it] = per_iteration.get(it, 0) + 1
    expected = NUM_PROMPTS * NUM_GENERATIONS
    lost = sum(max(0, expected - per_iteration.get(it, 0)) for it in range(ITERATIONS))
    twice = sum(1 for n in per_group.values() if n > NUM_GENERATIONS)
    lags = [int(learner[it]) - v for it, _, v in rows if it in learner]
    return lost, twice, lags


def check_worker_fault(fault: str, run_dir: Path, final: int | None) -> Outcome:
    """Judge a distributed run in which one worker was killed or stopped (see the module docstring)."""
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    lost, twice, lags = groups_check(run_dir)
    [totals] = [e["data"] for e in r["events"] if e["kind"] == "distributed"] or [{}]
    losses = [e["message"] for e in r["events"] if e["kind"] == "worker_lost"]
    in_bound = bool(lags) and 0 <= min(lags) and max(lags) <= 1
    ok = len(losses) == 1 and lost == 0 and twice == 0 and in_bound and not bad
    detail = (f"{len(losses)} worker lost, {totals.get('jobs_redone')} jobs redone, {twice} groups stored twice, "
              f"staleness {min(lags, default=None)}..{max(lags, default=None)}")
    return Outcome(fault, ok, lost, len(bad), detail=detail, notes=losses)


def check_driver_kill(fault: str, run_dir: Path, before: dict[str, str], last_good: int | None,
                      final: int | None) -> Outcome:
    """Judge a distributed run whose driver was killed, then resumed (see the module docstring)."""
    out = check_kill(fault, run_dir, before, final)
    _, twice, _ = groups_check(run_dir)
    resumed = [e["message"] for e in read_run(run_dir)["events"] if e["kind"] == "resume"]
    from_good = bool(resumed) and resumed[0].endswith(f"from version {last_good}")
    out.recovered = out.recovered and twice == 0 and from_good
    out.detail += f"; {twice} groups stored twice; {resumed[0] if resumed else 'no resume event'}"
    return out


def newest_servable(run_dir: Path) -> int | None:
    """The version a resume must start from: the newest base or promoted version with a complete folder."""
    from selfrl import adapters

    servable = [v["version"] for v in read_run(run_dir)["versions"] if v["status"] in ("promoted", "base")
                and adapters.verify_version(Path(v["path"])) is None]
    return max(servable, default=None)


def run_distributed_fault(fault: str, model_dir: Path, work: Path) -> Outcome:
    """Inject one distributed fault (``worker:...`` or ``ray:kill:...``) into a fresh ``--ray local`` run."""
    t0 = time.perf_counter()
    run_dir = work / fault.replace(":", "_").replace("@", "_at_")
    partition = fault.startswith("worker:stop:")
    config = write_config(work / f"{run_dir.name}.toml", model_dir, distributed=True,
                          job_timeout_s=PARTITION_TIMEOUT_S if partition else 60.0, num_workers=1 if partition else 2)
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    if fault.startswith("worker:"):
        proc = run_child(args, worker_fault=fault.removeprefix("worker:"))
        out = (check_worker_fault(fault, run_dir, final_version(proc.stdout)) if proc.returncode == 0 else
               Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}"))
    else:
        killed = run_child(args, fault.removeprefix("ray:"))
        if killed.returncode != -signal.SIGKILL:
            return Outcome(fault, False, detail=f"not killed: exit {killed.returncode}: {killed.stderr[-400:]}")
        before, last_good = snapshot(run_dir), newest_servable(run_dir)
        proc = run_child(["--config", str(config), "--resume", str(run_dir)])
        out = (check_driver_kill(fault, run_dir, before, last_good, final_version(proc.stdout))
               if proc.returncode == 0 else Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}"))
    out.seconds = time.perf_counter() - t0
    return out


def distributed_faults() -> list[str]:
    """The distributed faults, or none when Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        return []
    from selfrl.distributed.worker import WORKER_FAULT_POINTS

    return ([f"worker:kill:{p}" for p in WORKER_FAULT_POINTS] + ["worker:stop:mid_rollout"]
            + ["ray:kill:after_store@1", "ray:kill:during_update@1"])


def all_faults() -> list[str]:
    from selfrl.faults import POINTS

    return ["lr_x1000@1", "noise@1", "nan_loss@1"] + [f"kill:{p}@1" for p in POINTS] + distributed_faults()


def table(outcomes: list[Outcome]) -> str:
    """The summary table and one line per fault (plain text, Markdown-compatible)."""
    lines = ["| fault | recovered | trajectories lost | corrupt versions served | seconds | detail |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {o.fault} | {'yes' if o.recovered else 'NO'} | {o.trajectories_lost} | "
              f"{o.corrupt_versions_served} | {o.seconds:.0f} | {o.detail} |" for o in outcomes]
    totals = (f"| {len(outcomes)} | {sum(o.recovered for o in outcomes)} | "
              f"{sum(o.trajectories_lost for o in outcomes)} | {sum(o.corrupt_versions_served for o in outcomes)} |")
    lines += ["", "| faults injected | faults recovered | trajectories lost | corrupt versions served |",
              "|---|---|---|---|", totals]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/fault_suite.json", help="where the JSON rows go")
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    p.add_argument("--faults", nargs="*", help="only these faults (default: all)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = save_tiny_model(work / "tiny-model")
        outcomes = []
        for fault in args.faults or all_faults():
            distributed = fault.startswith(("worker:", "ray:"))
            outcomes.append((run_distributed_fault if distributed else run_fault)(fault, model_dir, work))
            print(f"{fault}: {'recovered' if outcomes[-1].recovered else 'NOT RECOVERED'} "
                  f"({outcomes[-1].seconds:.0f} s) {outcomes[-1].detail}", flush=True)
    print(table(outcomes))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"faults_injected": len(outcomes), "faults_recovered": sum(o.recovered for o in outcomes),
               "trajectories_lost": sum(o.trajectories_lost for o in outcomes),
               "corrupt_versions_served": sum(o.corrupt_versions_served for o in outcomes)}
    out.write_text(json.dumps({"summary": summary, "faults": [asdict(o) for o in outcomes]}, indent=2))
    print(f"written: {out}")
    ok = summary["faults_recovered"] == summary["faults_injected"] and not summary["trajectories_lost"] \
        and not summary["corrupt_versions_served"]
    return 0 if ok else 1


def child(argv: list[str]) -> int:
    """``selfrl`` with the test reward ``short`` registered (the subprocess side)."""
    from selfrl.cli import main as cli_main
    from selfrl.rewards import REWARD_FUNCS

    REWARD_FUNCS["short"] = short
    return cli_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
