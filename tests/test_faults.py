"""Fault injection: destructive updates are rolled back, NaN losses skipped, kills resumed
with nothing lost, and no incomplete adapter version is ever served.

The corrupting faults run in process (``selfrl.run.main.run`` on a tiny Phi saved to disk,
``SELFRL_FAULT`` set); one kill runs ``selfrl run`` as a real subprocess that SIGKILLs
itself, then resumes. The whole kill matrix (every point of ``selfrl.core.faults.POINTS``) is
marked slow; ``scripts/fault_suite.py`` runs it and prints the table (the faults and their
checks are in ``scripts/fault_runs.py``).
"""

import json
import shutil
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

from selfrl.record import adapters
from selfrl.core import faults
from selfrl.config import load_config
from selfrl.run.main import run
from selfrl.envs.rewards import REWARD_FUNCS
from selfrl.record.store import Store

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
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
    """The report's PNGs (about 0.2 s each, 30 of them) are not what these tests check."""
    monkeypatch.setattr("selfrl.report.run.plot_metrics", lambda rows, plot_dir: {})


@pytest.fixture
def inject(monkeypatch):
    """``inject(spec)`` sets ``SELFRL_FAULT`` for this test; the iteration counter is reset after."""
    yield lambda spec: monkeypatch.setenv(faults.ENV, spec)
    faults.set_iteration(-1)


def config(model_dir, run_dir, iterations=runs.ITERATIONS, **overrides):
    path = runs.write_config(Path(run_dir).parent / f"{Path(run_dir).name}.toml", model_dir, iterations)
    return load_config(path, {"run_dir": str(run_dir), **overrides})


# ------------------------------------------------------------------ the hook itself


def test_parse_and_reject_bad_fault_specs():
    assert faults.parse("kill:during_update@2,noise@0") == [
        faults.Fault("kill", "during_update", 2), faults.Fault("noise", None, 0)]
    with pytest.raises(ValueError, match="needs '@<iteration>'"):
        faults.parse("nan_loss")
    with pytest.raises(ValueError, match="unknown fault kind 'boom'; valid: kill, lr_x1000, noise, nan_loss"):
        faults.parse("boom@1")
    with pytest.raises(ValueError, match="kill takes one point of after_rollout"):
        faults.parse("kill:lunch@1")


def test_kill_point_fires_only_at_its_point_and_iteration(inject, monkeypatch):
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    inject("kill:during_save@3")
    faults.set_iteration(2)
    faults.point("during_save")
    faults.set_iteration(3)
    faults.point("after_save")
    assert kills == []
    faults.point("during_save")
    assert kills == [faults.signal.SIGKILL]
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.point("nowhere")


# --------------------------------------------------------- complete versions only


def test_fault_file_is_read_at_each_hook_so_a_running_process_can_be_told_later(monkeypatch, tmp_path):
    trigger = tmp_path / "fault"
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setenv(faults.ENV_FILE, str(trigger))
    faults.set_iteration(3)
    try:
        assert not faults.active("noise")  # no file yet: nothing injected
        trigger.write_text("noise@3\n")
        assert faults.active("noise") and not faults.active("nan_loss")
        faults.set_iteration(4)
        assert not faults.active("noise")  # only at its iteration
        trigger.write_text("nan_loss@4")
        assert faults.active("nan_loss")
        monkeypatch.setenv(faults.ENV, "lr_x1000@4")  # both sources count
        assert faults.active("lr_x1000") and faults.active("nan_loss")
        trigger.write_text("boom@4")
        with pytest.raises(ValueError, match="unknown fault kind 'boom'"):
            faults.active("noise")
        monkeypatch.delenv(faults.ENV_FILE)  # without the variable the file is never read
        assert not faults.active("nan_loss")
    finally:
        faults.set_iteration(-1)


def test_saved_version_verifies_and_damage_is_detected(tiny_peft_model, tmp_path):
    path = adapters.save_version(tiny_peft_model, tmp_path, 3)
    assert adapters.verify_version(path) is None
    marker = json.loads((path / adapters.MARKER).read_text())
    assert marker["version"] == 3 and {"adapter_model.safetensors", "adapter_config.json"} <= set(marker["sha256"])
    state = adapters.load_version_state(path)
    assert all(torch.equal(state[k], v) for k, v in adapters.lora_state(tiny_peft_model).items())
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor byte
    weights.write_bytes(bytes(data))
    assert adapters.verify_version(path) == "adapter_model.safetensors does not match its checksum"
    with pytest.raises(adapters.CorruptVersionError, match="cannot be served"):
        adapters.load_version_state(path)
    (path / adapters.MARKER).unlink()
    assert "no completion marker" in adapters.verify_version(path)
    assert "is missing" in adapters.verify_version(tmp_path / "nothing")


def test_stray_dirs_are_temporary_or_unrecorded_folders(tiny_peft_model, tmp_path):
    for v in (0, 1, 2):
        adapters.save_version(tiny_peft_model, tmp_path, v)
    (tmp_path / "adapters" / ".v000003-abc").mkdir()
    strays = adapters.stray_dirs(tmp_path, {0, 1})
    assert [p.name for p in strays] == [".v000003-abc", "v000002"]
    moved = adapters.quarantine(strays[1])
    assert moved.parent.name == ".recovered" and (moved / adapters.MARKER).is_file()
    assert adapters.stray_dirs(tmp_path, {0, 1}) == [strays[0]]  # .recovered is not a stray


# ------------------------------------------------------------- corrupting faults


def collapse_event(run_dir):
    with Store(run_dir / "selfrl.db") as store:
        return next(e for e in store.events() if e["kind"] == "collapse")


@pytest.mark.parametrize("fault", ["noise@1", "nan_loss@1"])
def test_corrupting_fault_is_recovered(fault, model_dir, tmp_path, inject):
    inject(fault)
    result = run(config(model_dir, tmp_path / "run", iterations=2))
    out = runs.check_corrupting(fault, tmp_path / "run", result.final_version)
    assert out.recovered, out.detail
    assert (out.trajectories_lost, out.corrupt_versions_served) == (0, 0)
    if fault.startswith("noise"):
        event = collapse_event(tmp_path / "run")
        assert event["data"]["rolled_back"] == [2] and event["data"]["iteration"] == 1


def test_destructive_update_rolled_back_and_spent_budget_stops_cleanly(model_dir, tmp_path, inject):
    inject("lr_x1000@1")
    result = run(config(model_dir, tmp_path / "run", **{"collapse.max_rollbacks": 0}))
    out = runs.check_corrupting("lr_x1000@1", tmp_path / "run", result.final_version)
    assert out.recovered, out.detail
    event = collapse_event(tmp_path / "run")
    # rolled back in the iteration of the fault, with the safer setting from CollapseConfig's factors
    assert event["data"]["iteration"] == 1 and event["data"]["serving"] == 1 and event["data"]["rolled_back"] == [2]
    assert event["data"]["learning_rate"] == pytest.approx(5e-4) and event["data"]["beta"] == pytest.approx(0.1)
    alarm = event["data"]["alarms"][0]
    assert alarm["rule"] == "kl" and alarm["value"] > alarm["threshold"] == 0.5
    # max_rollbacks = 0: that one rollback spends the budget, so the run stops before iteration 2
    assert result.stopped_early and result.final_version == 1
    with Store(tmp_path / "run" / "selfrl.db") as store:
        kinds = [e["kind"] for e in store.events()]
        steps = {m["step"] for m in store.metrics() if m["name"] == "reward/mean"}
        status = {v["version"]: v["status"] for v in store.versions()}
    assert kinds[-2:] == ["collapse", "collapse_stop"] and steps == {0, 1}
    assert status == {0: "base", 1: "promoted", 2: "rolled_back"}
    assert "collapse.max_rollbacks" in (tmp_path / "run" / "report.md").read_text()


def test_run_prints_the_step_back_after_a_stable_stretch(model_dir, tmp_path, inject):
    """As the collapse it follows: the ``step_back`` event's message is a progress line too."""
    from selfrl.run.progress import PlainProgress

    lines = []

    class Lines(PlainProgress):
        def log(self, message: str) -> None:
            lines.append(message)

    inject("lr_x1000@1")  # iteration 1 collapses (the kl rule); iteration 2 is the stable stretch
    run(config(model_dir, tmp_path / "run", iterations=3, **{"collapse.stable_updates": 1}), progress=Lines())
    with Store(tmp_path / "run" / "selfrl.db") as store:
        events = {e["kind"]: e["message"] for e in store.events()}
    assert events["step_back"].startswith("iteration 2: stable since the last collapse or step: backoff level 0, ")
    assert events["collapse"] in lines and events["step_back"] in lines
    assert lines.index(events["collapse"]) < lines.index(events["step_back"])


# ------------------------------------------------------------------ crash safety


def test_resume_skips_a_damaged_served_version_and_clears_strays(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run(config(model_dir, run_dir, iterations=2))
    with Store(run_dir / "selfrl.db") as store:
        before = {t.id: t.to_dict() for t in store.trajectories()}
        promoted = [v["version"] for v in store.versions() if v["status"] == "promoted"]
    assert promoted == [1, 2]
    (adapters.version_dir(run_dir, 2) / "adapter_model.safetensors").write_bytes(b"half")  # damaged
    (run_dir / "adapters" / ".v000003-killed").mkdir()  # what a kill during a save leaves
    shutil.copytree(adapters.version_dir(run_dir, 1), adapters.version_dir(run_dir, 3))  # saved, never recorded
    result = run(config(model_dir, run_dir, iterations=3), resume=True)
    with Store(run_dir / "selfrl.db") as store:
        after = {t.id: t.to_dict() for t in store.trajectories()}
        events = store.events()
        versions = {v["version"]: v for v in store.versions()}
        first_new = store.trajectories(iteration=2)[0]
    assert {k: after[k] for k in before} == before and len(after) == len(before) + 8
    assert versions[2]["status"] == "rolled_back" and "checksum" in versions[2]["metrics"]["corrupt"]
    assert first_new.adapter_version == 1  # served the last complete version, not the damaged one
    assert any(e["kind"] == "corrupt_version" and "version 2" in e["message"] for e in events)
    assert sum(e["kind"] == "recover" for e in events) == 2
    assert not (run_dir / "adapters" / ".v000003-killed").exists()
    assert adapters.verify_version(versions[3]["path"]) is None  # v3 is the resumed run's own new candidate
    assert result.final_version != 2


def kill_and_resume(fault, model_dir, tmp_path):
    out = runs.run_fault(fault, model_dir, tmp_path)
    assert out.recovered, out.detail
    assert (out.trajectories_lost, out.corrupt_versions_served) == (0, 0)
    return out


def test_kill_during_save_then_resume_loses_nothing(model_dir, tmp_path):
    # the kill in a real subprocess; the resume in process (saves a second start-up)
    run_dir = tmp_path / "run"
    cfg = config(model_dir, run_dir)
    killed = runs.run_child(["--config", str(run_dir.parent / "run.toml"), "--run-dir", str(run_dir)],
                             "kill:during_save@1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list((run_dir / "adapters").glob(".v000002-*"))  # the half-written save is there
    before = runs.snapshot(run_dir)
    assert len(before) == 16  # iterations 0 and 1 were stored before the kill
    result = run(cfg, resume=True)
    out = runs.check_kill("kill:during_save@1", run_dir, before, result.final_version)
    assert out.recovered, out.detail
    assert (out.trajectories_lost, out.corrupt_versions_served) == (0, 0)
    assert out.notes and "left by an interrupted save" in out.notes[0]


@pytest.mark.slow
@pytest.mark.parametrize("point", [p for p in faults.POINTS if p != "during_save"])
def test_kill_at_every_point_then_resume_loses_nothing(point, model_dir, tmp_path):
    out = kill_and_resume(f"kill:{point}@1", model_dir, tmp_path)
    assert out.recovered and (out.trajectories_lost, out.corrupt_versions_served) == (0, 0)


def test_store_rows_are_all_or_nothing_under_a_failed_write(tmp_path):
    # a trajectory list that fails halfway (unencodable value) leaves no row of it behind
    from selfrl.core.trajectory import Trajectory

    with Store(tmp_path / "s.db") as store:
        run_id = store.start_run({})
        good = Trajectory("t", "g", 0, rewards={"r": 1.0})
        bad = Trajectory("t", "g", 0, rewards={"r": 1.0})
        bad.messages = [{"role": "user", "content": object()}]
        with pytest.raises(TypeError):
            store.add_trajectories(run_id, 0, [good, bad])
    conn = sqlite3.connect(tmp_path / "s.db")
    assert conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM rewards").fetchone()[0] == 0
