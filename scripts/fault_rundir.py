"""The run directory's faults in the fault suite (``scripts/fault_suite.py``): the disk fills,
the disk turns read-only, the run directory is moved, a version folder is gone. Each runs
the tiny ``selfrl run`` of ``fault_runs.py`` as a subprocess and judges it the way a kill is
judged (:func:`fault_runs.check_kill`: nothing stored before the fault lost or changed, the
run finished, no corrupt version served), plus what the fault itself must show:

* ``disk_full``: the run writes into a 400 KiB tmpfs and fills it. It must stop with exit
  code 1 and one line, ``selfrl: error: disk full at PATH: free space and run with --resume
  RUN_DIR``, and no traceback; then the file system grows to 16 MiB and ``--resume`` must
  finish the run.
* ``read_only``: a run of two iterations on a tmpfs, which is then remounted read-only;
  ``--resume`` for the third must stop the same way (``read-only file system at ...``), and
  finish once the file system is writable again.
* ``relocate``: a run SIGKILLed after a save of iteration 1, its directory moved (``mv``),
  then ``--resume`` from the new place: every version must still verify and be served as
  before (no ``missing_version`` or ``corrupt_version`` event, no row rewritten), and every
  stored version path must be relative to the run directory.
* ``missing_version``: a finished run whose newest promoted version's folder is moved out;
  ``--resume`` for one more iteration must say it is missing (a ``missing_version`` event),
  serve the version before it, and leave its row ``promoted``; with the folder back it
  verifies again.

The disk faults need root and ``mount -t tmpfs`` (``tests/smallfs.py``); elsewhere they raise
:class:`smallfs.SmallFsUnavailable` and the suite lists them as skipped.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import sys
import time
from pathlib import Path

from fault_runs import ITERATIONS, Outcome, check_kill, final_version, read_run, run_child, snapshot, write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smallfs import SmallFs, SmallFsUnavailable  # noqa: E402,F401 (SmallFsUnavailable: raised to the suite)

RUNDIR_FAULTS = ("disk_full", "read_only", "relocate", "missing_version")
DISK_FULL_KIB = 400  # the tiny run's store grows past this in its first iterations (its plots alone take 700 KiB)
ROOMY_KIB = 16384
ONE_LINE = re.compile(r"selfrl: error: (?P<what>[^:]+) at (?P<path>.+?): (?P<fix>.+) "
                      r"and run with --resume (?P<dir>\S+)")


def one_line_failure(proc, what: str, run_dir: Path) -> str | None:
    """None when ``proc`` exited 1 with no traceback and its last line on stderr is ``selfrl:
    error: <what> at PATH: <fix> and run with --resume <run_dir>``; else what was wrong."""
    lines = proc.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    if proc.returncode != 1:
        return f"exit {proc.returncode}, not 1: {proc.stderr[-400:]}"
    if "Traceback" in proc.stderr:
        return f"a traceback: {proc.stderr[proc.stderr.index('Traceback'):][:400]}"
    m = ONE_LINE.fullmatch(last)
    if m is None or m["what"] != what or m["dir"] != str(run_dir):
        return f"last line {last!r}, not '{what} at ... and run with --resume {run_dir}'"
    return None


def stored_paths(run_dir: Path) -> dict[int, str]:
    """``adapter_versions.path`` as stored, not resolved: ``{version: path}``."""
    conn = sqlite3.connect(f"file:{run_dir / 'selfrl.db'}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT version, path FROM adapter_versions"))
    finally:
        conn.close()


def _config(work: Path, name: str, model_dir: Path) -> str:
    return str(write_config(work / f"{name}.toml", model_dir))


def _resumed(fault: str, run_dir: Path, before: dict, proc, iterations: int = ITERATIONS) -> Outcome:
    if proc.returncode != 0:
        return Outcome(fault, False, detail=f"--resume: exit {proc.returncode}: {proc.stderr[-600:]}")
    out = check_kill(fault, run_dir, before, final_version(proc.stdout), iterations)
    out.detail = out.detail.replace("before the kill", "before the fault" if fault != "relocate" else "before the kill")
    return out


def _said(proc, run_dir: Path) -> str:
    """The error line, with the run directory written RUN_DIR."""
    return proc.stderr.strip().splitlines()[-1].removeprefix("selfrl: error: ").replace(str(run_dir), "RUN_DIR")


def disk_full(model_dir: Path, work: Path) -> Outcome:
    fs = SmallFs(work / "disk_full", DISK_FULL_KIB)
    try:
        run_dir, config = fs.path / "run", _config(work, "disk_full", model_dir)
        proc = run_child(["--config", config, "--run-dir", str(run_dir)])
        if (wrong := one_line_failure(proc, "disk full", run_dir)) is not None:
            return Outcome("disk_full", False, detail=wrong)
        said = _said(proc, run_dir)
        before = snapshot(run_dir)
        fs.resize(ROOMY_KIB)
        out = _resumed("disk_full", run_dir, before, run_child(["--config", config, "--resume", str(run_dir)]))
        out.detail = f"stopped: '{said}'; {out.detail}"
        return out
    finally:
        fs.unmount()


def read_only(model_dir: Path, work: Path) -> Outcome:
    fs = SmallFs(work / "read_only", ROOMY_KIB)
    try:
        run_dir, config = fs.path / "run", _config(work, "read_only", model_dir)
        first = run_child(["--config", config, "--run-dir", str(run_dir), "--iterations", str(ITERATIONS - 1)])
        if first.returncode != 0:
            return Outcome("read_only", False, detail=f"first run: exit {first.returncode}: {first.stderr[-400:]}")
        before = snapshot(run_dir)
        fs.read_only()
        proc = run_child(["--config", config, "--resume", str(run_dir)])
        fs.read_only(False)
        if (wrong := one_line_failure(proc, "read-only file system", run_dir)) is not None:
            return Outcome("read_only", False, detail=wrong)
        said = _said(proc, run_dir)
        out = _resumed("read_only", run_dir, before, run_child(["--config", config, "--resume", str(run_dir)]))
        out.detail = f"stopped: '{said}'; {out.detail}"
        return out
    finally:
        fs.unmount()


def relocate(model_dir: Path, work: Path) -> Outcome:
    run_dir, moved, config = work / "relocate", work / "relocate-moved", _config(work, "relocate", model_dir)
    killed = run_child(["--config", config, "--run-dir", str(run_dir)], "kill:after_save@1")
    if killed.returncode != -signal.SIGKILL:
        return Outcome("relocate", False, detail=f"not killed: exit {killed.returncode}: {killed.stderr[-400:]}")
    before = snapshot(run_dir)
    run_dir.rename(moved)
    out = _resumed("relocate", moved, before, run_child(["--config", config, "--resume", str(moved)]))
    r = read_run(moved)
    marked = [e["message"] for e in r["events"] if e["kind"] in ("missing_version", "corrupt_version")]
    absolute = {v: p for v, p in stored_paths(moved).items() if p is None or Path(p).is_absolute()}
    out.recovered = out.recovered and not marked and not absolute
    out.detail = (f"moved after a kill at after_save@1; {out.detail}"
                  + (f"; marked: {marked}" if marked else "") + (f"; absolute paths: {absolute}" if absolute else ""))
    return out


def missing_version(model_dir: Path, work: Path) -> Outcome:
    run_dir, config = work / "missing_version", _config(work, "missing_version", model_dir)
    first = run_child(["--config", config, "--run-dir", str(run_dir)])
    if first.returncode != 0:
        return Outcome("missing_version", False, detail=f"first run: exit {first.returncode}: {first.stderr[-400:]}")
    before = snapshot(run_dir)
    gone = max(v["version"] for v in read_run(run_dir)["versions"] if v["status"] in ("promoted", "base"))
    folder = Path(next(v["path"] for v in read_run(run_dir)["versions"] if v["version"] == gone))
    aside = work / "missing_version-aside"
    folder.rename(aside)
    proc = run_child(["--config", config, "--resume", str(run_dir), "--iterations", str(ITERATIONS + 1)])
    aside.rename(folder)
    out = _resumed("missing_version", run_dir, before, proc, ITERATIONS + 1)
    r = read_run(run_dir)
    status = {v["version"]: v["status"] for v in r["versions"]}[gone]
    said = [e["message"] for e in r["events"] if e["kind"] == "missing_version" and e["data"]["version"] == gone]
    resumed = [e["message"] for e in r["events"] if e["kind"] == "resume"]
    out.recovered = (out.recovered and status == "promoted" and bool(said) and bool(resumed)
                     and f"from version {gone}" not in resumed[-1])
    out.detail = (f"version {gone}'s folder moved out: {resumed[-1] if resumed else 'no resume event'}; its row "
                  f"{status}; {len(said)} missing_version event(s); {out.detail}")
    return out


FAULTS = {"disk_full": disk_full, "read_only": read_only, "relocate": relocate, "missing_version": missing_version}


def run_rundir_fault(fault: str, model_dir: Path, work: Path) -> Outcome:
    """Inject one run-directory fault (:data:`RUNDIR_FAULTS`) under ``work``; returns its outcome.

    Raises:
        SmallFsUnavailable: a disk fault where no tmpfs can be mounted (the suite skips it).
    """
    t0 = time.perf_counter()
    out = FAULTS[fault](model_dir, work)
    out.seconds = time.perf_counter() - t0
    return out
