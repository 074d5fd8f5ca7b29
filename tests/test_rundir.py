"""The run directory: self-contained and relocatable, written by one process at a time, and a
write the machine refuses (a full or read-only disk) said in one line, with nothing lost.

The runs are the fault suite's tiny ``selfrl run`` (``scripts/fault_runs.py``); the disk
faults use a small tmpfs (the ``small_fs`` fixture, skipped where none can be mounted) or,
for every write point of a run, an injected failure.
"""

import errno
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from pydoc import locate

import pytest
import torch

from selfrl.record import adapters
from selfrl.record.adapters import lora_state
from selfrl.cli import main
from selfrl.config import load_config
from selfrl.run.main import run
from selfrl.envs.rewards import REWARD_FUNCS
from selfrl.record.rundir import resolve_version_path, run_relative, storable_path
from selfrl.record.runlock import RunDirLock, RunDirLocked
from selfrl.serve.service import ApiError, Service
from selfrl.record.store import Store
from selfrl.record.versions import Ledger
from selfrl.record.write_errors import write_failure
from serving import add_version, tiny_serve_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import fault_rundir  # noqa: E402
import fault_runs as runs  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return runs.save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module", autouse=True)
def short_reward():
    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "short", runs.short)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The report's PNGs are not what these tests check (about 0.2 s each)."""
    monkeypatch.setattr("selfrl.report.run.plot_metrics", lambda rows, plot_dir: {})


def config(model_dir, run_dir, iterations=runs.ITERATIONS, **overrides):
    path = runs.write_config(Path(run_dir).parent / f"{Path(run_dir).name}.toml", model_dir, iterations)
    return load_config(path, {"run_dir": str(run_dir), **overrides})


def rows(run_dir) -> dict[int, tuple[str, str | None]]:
    """``{version: (status, path as stored)}``, read with plain SQLite."""
    conn = sqlite3.connect(f"file:{Path(run_dir) / 'selfrl.db'}?mode=ro", uri=True)
    try:
        return {v: (s, p) for v, s, p in conn.execute("SELECT version, status, path FROM adapter_versions")}
    finally:
        conn.close()


def events(run_dir, kind: str) -> list[dict]:
    with Store(Path(run_dir) / "selfrl.db", readonly=True) as store:
        return [e for e in store.events() if e["kind"] == kind]


# ------------------------------------------------------------------ relocatable


def test_version_paths_are_stored_relative_and_old_rows_re_rooted(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    assert storable_path(run_dir / "adapters" / "v000003", run_dir) == "adapters/v000003"
    assert storable_path("/elsewhere/ckpt", run_dir) == "/elsewhere/ckpt"
    for old in ("/home/u/runs/a/adapters/v000003", "runs/a/adapters/v000003", "adapters/v000003"):
        assert run_relative(old) == "adapters/v000003"
        assert resolve_version_path(old, tmp_path / "moved") == str(tmp_path / "moved" / "adapters" / "v000003")
    assert resolve_version_path("/ckpt/1", run_dir) == "/ckpt/1" and run_relative("/ckpt/1") is None
    assert resolve_version_path(None, run_dir) is None


def test_a_moved_run_directory_resumes_from_its_own_versions(model_dir, tmp_path):
    first, moved = tmp_path / "run", tmp_path / "elsewhere" / "run2"
    run(config(model_dir, first, iterations=2))
    before = rows(first)
    assert {v: s for v, (s, _) in before.items()} == {0: "base", 1: "promoted", 2: "promoted"}
    moved.parent.mkdir()
    first.rename(moved)
    result = run(config(model_dir, moved, iterations=3), resume=True)
    after = rows(moved)
    assert {v: after[v] for v in before} == before  # no row rewritten
    assert all(p == f"adapters/v{v:06d}" for v, (_, p) in after.items())  # relative to the run directory
    assert events(moved, "missing_version") == [] and events(moved, "corrupt_version") == []
    assert [e["message"] for e in events(moved, "resume")] == ["resumed at iteration 2 from version 2"]
    with Store(moved / "selfrl.db", readonly=True) as store:
        assert all(adapters.verify_version(Path(v["path"])) is None and Path(v["path"]).parent.parent == moved
                   for v in store.versions())
        assert store.trajectories(iteration=2)[0].adapter_version == 2
    assert result.final_version >= 2


def test_an_old_store_with_absolute_and_working_dir_paths_is_read_after_a_move(tiny_peft_model, tmp_path,
                                                                              monkeypatch):
    # what older selfrl stored: the folder as given, absolute or relative to the working directory
    monkeypatch.chdir(tmp_path)
    old = Path("runs") / "a"
    with Store(old / "selfrl.db") as store:
        store.start_run({})
    conn = sqlite3.connect(old / "selfrl.db")
    for v, status in ((0, "base"), (1, "promoted"), (2, "promoted")):
        path = adapters.save_version(tiny_peft_model, old, v)
        stored = str(path.resolve()) if v != 1 else str(path)  # v1 relative to the working directory
        conn.execute("INSERT INTO adapter_versions (version, parent, path, status, created_at, metrics_json)"
                     " VALUES (?, ?, ?, ?, 0, '{}')", (v, v - 1 if v else None, stored, status))
    conn.commit()
    conn.close()
    moved = tmp_path / "moved"
    old.rename(moved)
    monkeypatch.chdir(tmp_path / "runs")  # another working directory too
    with Store(moved / "selfrl.db", readonly=True) as store:  # a reader re-roots them, writing nothing
        assert [v["path"] for v in store.versions()] == [str(adapters.version_dir(moved, v)) for v in (0, 1, 2)]
    assert rows(moved)[1] == ("promoted", "runs/a/adapters/v000001")
    with Store(moved / "selfrl.db") as store:  # a writer migrates them
        ledger = Ledger(store, 1, moved)
        assert ledger.latest_servable().version == 2 and ledger.missing == {}
    assert rows(moved) == {v: (s, f"adapters/v{v:06d}") for v, s in ((0, "base"), (1, "promoted"), (2, "promoted"))}


def test_a_missing_version_folder_is_said_and_skipped_not_rolled_back(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run(config(model_dir, run_dir, iterations=2))
    assert rows(run_dir)[2][0] == "promoted"
    folder, aside = adapters.version_dir(run_dir, 2), tmp_path / "v2-aside"
    folder.rename(aside)
    run(config(model_dir, run_dir, iterations=3), resume=True)
    assert rows(run_dir)[2] == ("promoted", "adapters/v000002")  # its record is kept as it was
    said = events(run_dir, "missing_version")
    assert [e["message"] for e in said] == [
        f"version 2's folder {folder} is missing: not served by this process (its record is kept; put the folder "
        "back and restart to serve it again)"]
    assert [e["message"] for e in events(run_dir, "resume")] == ["resumed at iteration 2 from version 1"]
    with Store(run_dir / "selfrl.db", readonly=True) as store:
        assert store.trajectories(iteration=2)[0].adapter_version == 1  # the version before it served
    aside.rename(folder)  # back: served again, as nothing was rewritten
    with Store(run_dir / "selfrl.db") as store:
        ledger = Ledger(store, 1, run_dir)
        ledger.latest_servable()
        assert 2 in [v.version for v in ledger.servable()] and ledger.missing == {}


def test_a_version_retention_pruned_is_not_said_missing_at_a_restart(tiny_peft_model, tmp_path):
    # each restart of a soaked server said "version N's folder is missing ... put the folder back"
    # for every version retention had deleted on purpose
    run_dir = tmp_path / "run"
    with Store(run_dir / "selfrl.db") as store:
        store.start_run({})
        ledger = Ledger(store, 1, run_dir)
        for v in (0, 1, 2):
            path = adapters.save_version(tiny_peft_model, run_dir, v)
            store.conn.execute("INSERT INTO adapter_versions (version, parent, path, status, created_at, metrics_json)"
                               " VALUES (?, ?, ?, ?, 0, '{}')", (v, v - 1 if v else None, str(path),
                                                                   "base" if v == 0 else "promoted"))
        store.conn.commit()
        ledger.mark_pruned(1, "deleted")
        shutil.rmtree(adapters.version_dir(run_dir, 1))
    with Store(run_dir / "selfrl.db") as store:  # the restart
        ledger = Ledger(store, 1, run_dir)
        assert ledger.latest_servable().version == 2 and ledger.missing == {}
        assert [e for e in store.events() if e["kind"] == "missing_version"] == []
        shutil.rmtree(adapters.version_dir(run_dir, 2))  # one gone without retention is still said
        assert Ledger(store, 1, run_dir).latest_servable().version == 0
        assert [e["data"]["version"] for e in store.events() if e["kind"] == "missing_version"] == [2]


def test_serve_on_a_moved_directory_lists_what_it_can_serve(tiny_tokenizer, tiny_model_factory, tmp_path):
    """A corrupt promoted version below the newest is marked at start and not listed; a missing
    one is not listed either, but keeps its row (and its pin); the newest complete one is served."""
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    first = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run"))
    states = {v: {k: torch.randn_like(t) for k, t in lora_state(model).items()} for v in (1, 2, 3)}
    try:
        for v in (1, 2, 3):
            add_version(first, states[v], v, parent=v - 1, metrics={"val/success": 0.5})
        first.pin(3)
    finally:
        first.close()
    moved = tmp_path / "moved"
    (tmp_path / "run").rename(moved)
    weights = adapters.version_dir(moved, 1) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # version 1 damaged
    adapters.version_dir(moved, 3).rename(tmp_path / "v3-aside")  # version 3 gone
    service = Service(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, tiny_serve_config(moved))
    try:
        assert service.engine.version == 2
        assert all(torch.equal(lora_state(service.engine.model)[k], t) for k, t in states[2].items())
        assert [v["version"] for v in service.version_ids()] == [0, 2]  # what /v1/models lists
        one, three = service.ledger.get(1), service.ledger.get(3)
        assert one.status.value == "rolled_back" and "checksum" in one.metrics["corrupt"]
        assert three.status.value == "promoted" and 3 in service.ledger.missing
        assert service.pinned is None and json.loads((moved / "pinned.json").read_text()) == {"version": 3}
        for v in (1, 3):
            with pytest.raises(ApiError) as e:
                service.versions.check_servable(v)
            assert e.value.status == 409
    finally:
        service.close()
    (tmp_path / "v3-aside").rename(adapters.version_dir(moved, 3))
    again = Service(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, tiny_serve_config(moved))
    try:
        assert again.engine.version == again.pinned == 3  # the folder is back: served, and pinned, again
        assert [v["version"] for v in again.version_ids()] == [0, 2, 3]
    finally:
        again.close()


def test_a_version_folder_holding_another_versions_files_does_not_verify(tiny_peft_model, tmp_path):
    adapters.save_version(tiny_peft_model, tmp_path, 1)
    shutil.copytree(adapters.version_dir(tmp_path, 1), adapters.version_dir(tmp_path, 2))  # a careless copy
    assert adapters.verify_version(adapters.version_dir(tmp_path, 1)) is None
    assert adapters.verify_version(adapters.version_dir(tmp_path, 2)) == "it holds version 1's files, not version 2's"


# ------------------------------------------------------------------ one writer


def test_one_lock_for_run_resume_report_and_serve(model_dir, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    with Store(run_dir / "selfrl.db") as store:
        store.start_run({})
    holder = RunDirLock(run_dir, "selfrl serve")
    try:
        for resume in (False, True):
            with pytest.raises(RunDirLocked, match=rf"in use by another selfrl process, selfrl serve \(pid "
                                                   rf"{os.getpid()}\).*stop it \(kill {os.getpid()}\)"):
                run(config(model_dir, run_dir), resume=resume)
        capsys.readouterr()
        assert main(["report", str(run_dir)]) == 1  # it would write report.md into the run directory
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"selfrl: error: {run_dir} is in use by another selfrl process, selfrl serve (pid ")
        assert line.endswith(f"or write the report elsewhere: selfrl report {run_dir} --out DIR")
        assert main(["report", str(run_dir), "--out", str(tmp_path / "out")]) == 0  # a reader is never refused
        assert (tmp_path / "out" / "report.md").exists() and not (run_dir / "report.md").exists()
        monkeypatch.setattr("selfrl.serve.main.serve", lambda *a, **k: RunDirLock(run_dir, "selfrl serve"))
        assert main(["serve", "--run-dir", str(run_dir)]) == 1  # one line, no traceback
        assert capsys.readouterr().err.count("\n") == 1
    finally:
        holder.release()
    assert (run_dir / "selfrl.lock").read_text() == ""  # released: no holder named to the next one refused
    assert main(["report", str(run_dir)]) == 0


def child(args: list[str]) -> subprocess.Popen:
    """``selfrl run ARGS`` (the suite's child, with the reward ``short``) started in the background."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("SELFRL_FAULT", None)
    return subprocess.Popen([sys.executable, str(runs.SCRIPT), "child", "run", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_writer_process_is_refused_and_a_killed_one_blocks_nothing(model_dir, tmp_path):
    run_dir, toml = tmp_path / "run", str(runs.write_config(tmp_path / "run.toml", model_dir))
    first = child(["--config", toml, "--run-dir", str(run_dir), "--iterations", "50"])
    try:
        deadline = time.monotonic() + 120
        while not adapters.version_dir(run_dir, 0).exists():  # its store is made, its base version saved
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # the first writer holds the run directory, mid-run
        assert json.loads((run_dir / "selfrl.lock").read_text())["pid"] == first.pid
        for args in (["--run-dir", str(run_dir)], ["--resume", str(run_dir)]):  # a second run, a second resume
            second = runs.run_child(["--config", toml, *args])
            assert second.returncode == 1, second.stderr[-2000:]
            assert "Traceback" not in second.stderr
            assert second.stderr.strip().splitlines()[-1] == (
                f"selfrl: error: {run_dir} is in use by another selfrl process, selfrl run (pid {first.pid}), "
                f"which holds {run_dir / 'selfrl.lock'}; wait for it to end or stop it (kill {first.pid}), "
                "or choose another run directory")
        os.kill(first.pid, signal.SIGKILL)  # killed: the kernel drops its lock
        first.wait(timeout=30)
        before = runs.snapshot(run_dir)
        resumed = runs.run_child(["--config", toml, "--resume", str(run_dir)])
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert {k: v for k, v in runs.snapshot(run_dir).items() if k in before} == before
        assert [e["kind"] for e in events(run_dir, "resume")] == ["resume"]  # one lineage: one resume, no other
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_reader_reads_a_store_whose_writer_was_killed_in_its_first_write(tmp_path):
    # a kill inside the first transaction, before the store is in WAL mode, leaves a hot journal
    # (the committed part holds a runs table, as a store does: a file without one is not a store)
    db = tmp_path / "selfrl.db"
    code = ("import os, sqlite3, sys\nc = sqlite3.connect(sys.argv[1]); c.execute('CREATE TABLE runs (id)'); c.execute('CREATE TABLE t (x)'); c.commit()\n"
            "c.execute('BEGIN'); c.executemany('INSERT INTO t VALUES (?)', [('x' * 1000,)] * 5000)\nos._exit(9)\n")
    subprocess.run([sys.executable, "-c", code, str(db)], check=False)
    assert (tmp_path / "selfrl.db-journal").exists()
    with Store(db, readonly=True) as store:
        assert store.conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0  # the half-written rows are gone


# ------------------------------------------------------------------ refused writes


def test_write_failure_names_each_cause():
    def cause(e):
        f = write_failure(e, "RUN")
        return None if f is None else f.message("run with --resume RUN")

    assert cause(OSError(errno.ENOSPC, "No space left on device", "RUN/x")) == (
        "disk full at RUN/x: free space and run with --resume RUN")
    assert cause(OSError(errno.EDQUOT, "Disk quota exceeded")).startswith("disk quota exceeded at RUN: free space")
    assert cause(OSError(errno.EROFS, "Read-only file system", "RUN/selfrl.lock")).startswith(
        "read-only file system at RUN/selfrl.lock: make it writable")
    assert cause(PermissionError(errno.EACCES, "Permission denied", "RUN/p.png")).startswith(
        "permission denied at RUN/p.png:")
    assert cause(sqlite3.OperationalError("database or disk is full")).startswith("disk full at RUN/selfrl.db:")
    assert cause(sqlite3.OperationalError("attempt to write a readonly database")).startswith(
        "read-only file system at RUN/selfrl.db:")
    from safetensors import SafetensorError

    assert cause(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
                 ).startswith("disk full at RUN:")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "RUN/m.jsonl")
        except OSError as e:
            raise RuntimeError("flush failed") from e
    except RuntimeError as chained:
        assert cause(chained).startswith("disk full at RUN/m.jsonl:")
    for other in (ValueError("bad"), FileNotFoundError(errno.ENOENT, "x", "y"), sqlite3.IntegrityError("UNIQUE"),
                  ConnectionRefusedError(errno.ECONNREFUSED, "refused")):
        assert cause(other) is None


def fail_when(target: str, exc: BaseException, when):
    """A stand-in for ``target`` (dotted) that raises ``exc`` on a call for which ``when(*args)`` holds
    and calls the original otherwise."""
    original = locate(target)

    def call(*args, **kwargs):
        if when(*args):
            raise exc
        return original(*args, **kwargs)
    return call


def always(*args):
    return True


@pytest.mark.parametrize("where, target, when, exc, said", [
    ("config", "selfrl.run.setup.write_atomic", always,
     OSError(errno.ENOSPC, "No space left on device", "{run}/config.json"),
     "disk full at {run}/config.json: free space and run the same command again"),
    ("store", "selfrl.run.setup.Store", always, sqlite3.OperationalError("database or disk is full"),
     "disk full at {run}/selfrl.db: free space and run the same command again"),
    ("metrics", "selfrl.record.store.Store.log_metrics", lambda store, run_id, step, metrics: "reward/mean" in metrics,
     sqlite3.OperationalError("database or disk is full"),
     "disk full at {run}/selfrl.db: free space and run with --resume {run}"),
    ("save", "selfrl.record.adapters._fsync_tree", lambda path: path.name.startswith(".v000001"),
     OSError(errno.EDQUOT, "Disk quota exceeded"),
     "disk quota exceeded at {run}: free space or raise the quota and run with --resume {run}"),
    ("plots", "selfrl.report.run.plot_metrics", always,
     PermissionError(errno.EACCES, "Permission denied", "{run}/plots/kl.png"),
     "permission denied at {run}/plots/kl.png: give this user write access and run with --resume {run}"),
])
def test_a_refused_write_anywhere_in_a_run_is_one_line(where, target, when, exc, said, model_dir, tmp_path,
                                                       monkeypatch, capsys):
    run_dir = tmp_path / "run"
    toml = runs.write_config(tmp_path / "run.toml", model_dir, 2)
    if isinstance(exc, OSError) and exc.filename:
        exc = type(exc)(exc.errno, exc.strerror, exc.filename.format(run=run_dir))
    with monkeypatch.context() as m:
        m.setattr(target, fail_when(target, exc, when))
        assert main(["run", "--config", str(toml), "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "selfrl: error: " + said.format(run=run_dir)
    if where in ("save", "metrics"):  # what was stored is intact, nothing half-written is left, resume finishes
        before = runs.snapshot(run_dir)
        assert len(before) == 8  # iteration 0's trajectories
        assert list((run_dir / "adapters").glob(".v*")) == []
        result = run(config(model_dir, run_dir, iterations=2), resume=True)
        out = runs.check_kill(where, run_dir, before, result.final_version, 2)
        assert out.recovered and (out.trajectories_lost, out.corrupt_versions_served) == (0, 0), out.detail


def test_a_full_disk_stops_selfrl_run_in_one_line_and_resume_finishes(model_dir, tmp_path, small_fs, capsys):
    fs = small_fs(fault_rundir.DISK_FULL_KIB)
    run_dir, toml = fs.path / "run", str(runs.write_config(tmp_path / "run.toml", model_dir))
    assert main(["run", "--config", toml, "--run-dir", str(run_dir)]) == 1  # no traceback: main returned
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"selfrl: error: disk full at {run_dir / 'selfrl.db'}: free space and run with --resume {run_dir}")
    before = runs.snapshot(run_dir)
    assert before  # it stopped mid-run, with trajectories stored
    fs.resize(fault_rundir.ROOMY_KIB)  # space freed
    result = run(config(model_dir, run_dir), resume=True)
    out = runs.check_kill("disk_full", run_dir, before, result.final_version)
    assert out.recovered and (out.trajectories_lost, out.corrupt_versions_served) == (0, 0), out.detail


def test_a_read_only_disk_stops_resume_in_one_line(model_dir, tmp_path, small_fs, capsys):
    fs = small_fs(fault_rundir.ROOMY_KIB)
    run_dir, toml = fs.path / "run", str(runs.write_config(tmp_path / "run.toml", model_dir, 1))
    run(config(model_dir, run_dir, iterations=1))
    before = runs.snapshot(run_dir)
    fs.read_only()
    capsys.readouterr()
    assert main(["run", "--config", toml, "--resume", str(run_dir), "--iterations", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"selfrl: error: read-only file system at {run_dir / 'selfrl.lock'}: make it writable (or copy the run "
        f"directory to a writable disk) and run with --resume {run_dir}")
    assert runs.snapshot(run_dir) == before
