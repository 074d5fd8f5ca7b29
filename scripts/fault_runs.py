"""The faults of ``selfrl run`` in the fault suite (``scripts/fault_suite.py``): the tiny run
they are injected into (a random Phi, a config, ``selfrl run`` as a subprocess with
``SELFRL_FAULT`` set), what a finished run stored, and the verdicts: a destructive update
rolled back in time, a NaN loss skipped, a kill resumed with nothing lost. See that file's
docstring for what "recovered" means; the serve and distributed faults build on this one.
The run directory's own faults (a full disk, a read-only one, a directory moved, a version
folder gone) are in ``fault_rundir.py``."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().with_name("fault_suite.py")  # its ``child`` command: selfrl with ``short``
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
    """Versions, events and per-step metrics of a finished run (read with ``selfrl.record.store.Store``)."""
    from selfrl.record.store import Store

    with Store(run_dir / "selfrl.db") as store:
        metrics: dict[int, dict[str, float]] = {}
        for m in store.metrics():
            metrics.setdefault(m["step"], {})[m["name"]] = m["value"]
        return {"versions": store.versions(), "events": store.events(), "metrics": metrics}


def corrupt_served(run_dir: Path, versions: list[dict], final: int | None) -> list[int]:
    """Versions marked served (promoted or base) whose folder is not complete, plus the
    run's final served version ``final`` when its folder does not load with matching checksums."""
    from selfrl.record import adapters

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


def check_kill(fault: str, run_dir: Path, before: dict[str, str], final: int | None,
               iterations: int = ITERATIONS) -> Outcome:
    """Judge a run killed (with ``before`` stored then) and resumed to the end (``iterations``),
    serving ``final`` (see the module docstring)."""
    after = snapshot(run_dir)
    lost = sum(1 for k, v in before.items() if after.get(k) != v)
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    done = sorted(s for s, m in r["metrics"].items() if "reward/mean" in m)
    finished = done == list(range(iterations))
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
