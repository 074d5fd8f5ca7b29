"""Fault-injection suite: poison, destroy and kill a tiny ``selfrl run``, then check that it recovered.

    .venv/bin/python scripts/fault_suite.py [--out runs/fault_suite.json] [--keep DIR]

Every fault runs ``selfrl run`` as a subprocess (``python scripts/fault_suite.py child ...``,
which registers the test reward ``short`` and calls ``selfrl.cli.main``) on a tiny
random Phi saved to a temporary folder, with ``SELFRL_FAULT`` set (see ``selfrl/core/faults.py``):

* ``lr_x1000@1``, ``noise@1``: a destructive update at iteration 1; recovered when a
  ``collapse`` event rolled that version back within one validation cycle and it is
  never served.
* ``nan_loss@1``: recovered when iteration 1's update was skipped as not finite and
  made no version.
* ``kill:<point>@1`` for every point of ``selfrl.core.faults.POINTS``: the process must die
  by SIGKILL; then ``--resume`` must finish the run; recovered when every trajectory
  stored before the kill is still there, byte for byte, and every version marked
  served (promoted or base) is complete (``adapters.verify_version``).

* ``serve:noise@1``, ``serve:lr_x1000@1``, ``serve:nan_loss@1``: the same faults in the
  second update of ``selfrl serve``'s background learner (in this process, uvicorn on
  loopback) while client threads keep sending rated chat requests; recovered when the
  collapse rules rolled the faulty candidate back (``nan_loss``: the update was skipped),
  every request got a 200, and every response named a version that existed, had been
  swapped in, is base or promoted, and is not older than the version served when it was
  sent (:func:`bad_served`).
* ``serve:disk_full`` (root only: ``mount -t tmpfs``; left out with a note elsewhere; in
  ``scripts/fault_serve_disk.py``): ``selfrl serve`` as a process, its run directory on a
  32 MB tmpfs that is filled up under the same rated traffic, then freed. Recovered when no
  request got a 500 or a cut stream, requests while full were refused with a 507/503 naming
  the fault (a stream already started ends with an error event and ``[DONE]``), ``/health``
  answered 503 ``degraded`` while full and ``ok`` after, every response acknowledged with a
  200 is in the store, and the learner paused, resumed by itself and made a new version.

Run-directory faults (in ``scripts/fault_rundir.py``, whose docstring has the details):

* ``disk_full``, ``read_only``: the run's disk (a small tmpfs) fills, or turns read-only;
  ``selfrl run`` must stop with exit code 1 and one line saying what happened and what to do
  (``disk full at PATH: free space and run with --resume RUN_DIR``), no traceback, and
  ``--resume`` must finish once the disk is fixed, with nothing lost. They need root and
  ``mount``; elsewhere they are listed as skipped.
* ``relocate``: a killed run's directory is moved, then resumed from the new place; every
  version serves as before.
* ``missing_version``: the newest promoted version's folder is gone; ``--resume`` says so,
  serves the one before, and leaves its row as it was.

Distributed faults (``selfrl run --ray local``, 2 rollout workers; only when Ray is installed; in
``scripts/fault_distributed.py``):

* ``worker:kill:<point>`` for each point of ``selfrl.run.ray.worker.WORKER_FAULT_POINTS``
  (``before_sampling``, ``mid_rollout``, ``after_sending``): the first worker to reach the
  point SIGKILLs itself (``SELFRL_WORKER_FAULT``); ``worker:stop:mid_rollout`` SIGSTOPs it
  instead (alive and silent, as a worker partitioned from the driver), and the driver
  must time it out (``job_timeout_s``, 4 s; this run has one worker, so it cannot finish
  without) and replace it. Recovered when the run finishes
  with exactly one ``worker_lost``, every iteration trained ``num_prompts`` whole groups
  (trajectories lost: the groups missing), no group stored twice, every trained group
  within the staleness bound, and no corrupt version served.
* ``ray:kill:<point>@1``: the *driver* of a distributed run is SIGKILLed at a point of
  ``selfrl.core.faults.POINTS``, then ``--resume`` (with ``--ray``) must finish the run from
  the last good version: every trajectory stored before the kill unchanged, no group id
  stored twice, the ``resume`` event naming the version that was the newest servable one
  at the kill, and no corrupt version served.

It prints a table (faults injected, recovered, trajectories lost, corrupt versions
served; for serve: requests, failed requests, bad versions served) and writes the rows
as JSON. ``tests/test_faults.py`` and ``tests/test_serve_faults.py`` run the same checks.

The suite is five modules in ``scripts/``: ``fault_runs.py`` (the tiny ``selfrl run``, its
faults and checks; the others build on it), ``fault_serve.py`` (the serve faults under
traffic), ``fault_serve_disk.py`` (the full disk under serve), ``fault_distributed.py`` (the
Ray faults) and this file (the list of faults, the
tables, the command line, and the ``child`` command the runs are started with).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's modules, beside this file
from fault_distributed import distributed_faults, run_distributed_fault  # noqa: E402
from fault_rundir import RUNDIR_FAULTS, SmallFsUnavailable, run_rundir_fault  # noqa: E402
from fault_runs import Outcome, run_fault, save_tiny_model, short  # noqa: E402
from fault_serve import ServeOutcome, run_serve_fault  # noqa: E402
from fault_serve_disk import run_serve_disk_full, serve_faults  # noqa: E402


def all_faults() -> list[str]:
    from selfrl.core.faults import POINTS

    return (["lr_x1000@1", "noise@1", "nan_loss@1"] + [f"kill:{p}@1" for p in POINTS] + list(RUNDIR_FAULTS)
            + [f"serve:{f}" for f in serve_faults()] + distributed_faults())


def serve_table(outcomes: list[ServeOutcome]) -> str:
    """The serve faults' table and totals (plain text, Markdown-compatible)."""
    lines = ["| fault | recovered | requests | failed requests | bad versions served | seconds | detail |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {o.fault} | {'yes' if o.recovered else 'NO'} | {o.requests} | {o.failed_requests} | "
              f"{o.bad_versions_served} | {o.seconds:.0f} | {o.detail} |" for o in outcomes]
    lines += ["", "| serve faults injected | recovered | requests | failed requests | bad versions served |",
              "|---|---|---|---|---|",
              f"| {len(outcomes)} | {sum(o.recovered for o in outcomes)} | {sum(o.requests for o in outcomes)} | "
              f"{sum(o.failed_requests for o in outcomes)} | {sum(o.bad_versions_served for o in outcomes)} |"]
    return "\n".join(lines)


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/fault_suite.json", help="where the JSON rows go")
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    p.add_argument("--faults", nargs="*", help="only these faults, e.g. noise@1 serve:noise@1 (default: all)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = save_tiny_model(work / "tiny-model")
        outcomes: list[Outcome] = []
        skipped: dict[str, str] = {}
        for fault in args.faults or all_faults():
            if fault == "serve:disk_full":
                outcomes.append(run_serve_disk_full(model_dir, work))
            elif fault.startswith("serve:"):
                outcomes.append(run_serve_fault(fault.removeprefix("serve:"), model_dir, work))
            elif fault.startswith(("worker:", "ray:")):
                outcomes.append(run_distributed_fault(fault, model_dir, work))
            elif fault in RUNDIR_FAULTS:
                try:
                    outcomes.append(run_rundir_fault(fault, model_dir, work))
                except SmallFsUnavailable as e:
                    skipped[fault] = str(e)
                    print(f"{fault}: skipped ({e})", flush=True)
                    continue
            else:
                outcomes.append(run_fault(fault, model_dir, work))
            print(f"{fault}: {'recovered' if outcomes[-1].recovered else 'NOT RECOVERED'} "
                  f"({outcomes[-1].seconds:.0f} s) {outcomes[-1].detail}", flush=True)
    runs = [o for o in outcomes if not isinstance(o, ServeOutcome)]
    serves = [o for o in outcomes if isinstance(o, ServeOutcome)]
    if runs:
        print(table(runs))
    if serves:
        print(serve_table(serves))
    for fault, why in skipped.items():
        print(f"skipped: {fault} ({why})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"faults_injected": len(outcomes), "faults_recovered": sum(o.recovered for o in outcomes),
               "trajectories_lost": sum(o.trajectories_lost for o in outcomes),
               "corrupt_versions_served": sum(o.corrupt_versions_served for o in outcomes),
               "serve_requests": sum(o.requests for o in serves),
               "serve_failed_requests": sum(o.failed_requests for o in serves),
               "serve_bad_versions_served": sum(o.bad_versions_served for o in serves)}
    out.write_text(json.dumps({"summary": summary, "faults": [asdict(o) for o in outcomes], "skipped": skipped},
                              indent=2))
    print(f"written: {out}")
    ok = summary["faults_recovered"] == summary["faults_injected"] and not summary["trajectories_lost"] \
        and not summary["corrupt_versions_served"] and not summary["serve_failed_requests"] \
        and not summary["serve_bad_versions_served"]
    return 0 if ok else 1


def child(argv: list[str]) -> int:
    """``selfrl`` with the test reward ``short`` registered (the subprocess side)."""
    from selfrl.cli import main as cli_main
    from selfrl.envs.rewards import REWARD_FUNCS

    REWARD_FUNCS["short"] = short
    return cli_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
