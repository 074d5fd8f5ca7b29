"""Retention of old served turns in ``selfrl serve`` (``[retention] trajectories_max_age_s``,
``selfrl.serve.retention``): exported with a checksum, then deleted; never a turn that may still be
trained; a failed export deletes nothing; the report and ``/health`` after pruning.

Turn times run on a fake clock (``Service(clock=)``), days apart, without waiting.
Old code: no setting, every turn kept for ever.
"""

from __future__ import annotations

import copy
import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from selfrl.config import ConfigError
from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.record.retention import verify_export
from selfrl.report.serve import write_serve_report
from selfrl.serve.health import health
from selfrl.serve.service import Service
from serving import tiny_serve_config

DAY = 86400.0
T0 = 1_000_000_000.0  # the fake clock's start (2001), seconds


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def config(run_dir, max_age_s: float = DAY, **learner):
    cfg = tiny_serve_config(run_dir, max_feedback_age_s=DAY, min_batch=4, max_batch=4, **learner)
    cfg.retention.trajectories_max_age_s = max_age_s
    return cfg


@pytest.fixture
def make(tiny_tokenizer, tiny_model_factory, tmp_path):
    """``make(cfg=None, learn=True) -> (service, clock)``; every service is closed after the test."""
    made = []

    def build(cfg=None, learn=True):
        clock = Clock()
        model = tiny_model_factory(lora=True, eos_bias=2.0)
        service = Service(model, tiny_tokenizer, cfg or config(tmp_path / "run"),
                          learner_model=copy.deepcopy(model) if learn else None, clock=clock)
        made.append(service)
        return service, clock

    yield build
    for s in made:
        s.close()


def store_turn(service, name: str, at: float, status: str = "pending", parent: str | None = None,
               family: str | None = None, reward: float | None = None) -> Trajectory:
    """One served turn (response ``name``, choice 0) stored at ``at`` on the server's clock, then
    marked ``status`` (``trained`` in version 0, or ``skipped``) as the learner marks it."""
    t = Trajectory(name, "g", 0, prompt_len=3, token_ids=[5, 6, 7, 10, 11], completion_mask=[0, 0, 0, 1, 1],
                   logprobs=[0.0, 0.0, 0.0, -0.5, -0.25], parent_id=parent)
    records.add_turns(service.store, service.run_id,
                      [records.ServedTurn(t, name, 0, "conv", "g", f"cont-{name}", "client", family)], now=at)
    if status != "pending":
        if reward is not None:
            t.rewards, t.reward = {"user_feedback": reward}, reward
        records.mark(service.store, [t], status, 0 if status == "trained" else None)
    return t


def feedback(service, name: str, value: float):
    return records.apply_feedback(service.store, name, 0, "explicit", value, rating=value, now=service.clock(),
                                  age=service.age_rule)


def served_ids(service) -> set[str]:
    return {r[0] for r in service.store.conn.execute("SELECT trajectory_id FROM served")}


def count(service, table: str) -> int:
    return int(service.store.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def test_old_turns_are_exported_with_a_checksum_then_deleted(make, tmp_path):
    service, clock = make()
    clock.t = T0 - 3 * DAY
    a = store_turn(service, "a", clock.t)
    assert feedback(service, "a", 1.0).outcome == "used"
    a.rewards, a.reward = {"user_feedback": 1.0}, 1.0
    records.mark(service.store, [a], "trained", 0)  # as the learner marks it
    clock.t = T0 - 2 * DAY
    b = store_turn(service, "b", clock.t, "skipped")
    c = store_turn(service, "c", clock.t)  # pending, never trained: past the age cutoff, no feedback can train it
    clock.t = T0 - DAY / 2
    d = store_turn(service, "d", clock.t, parent=c.id)  # continues c; young: kept
    e = store_turn(service, "e", clock.t, "skipped")  # young and skipped: feedback could still bring it back
    clock.t = T0
    assert feedback(service, "d", -1.0).outcome == "used"
    with service.store.lock:
        assert count(service, "rewards") == 1  # a's

    res = service.turn_retention.run_pass()

    assert res.rows == 3 and res.error is None
    assert res.path.parent == tmp_path / "run" / "exports" and res.path.name == "trajectories-20010909T014640Z.jsonl"
    assert verify_export(res.path) == 3
    lines = [json.loads(line) for line in res.path.read_text().splitlines()]
    assert [r["id"] for r in lines] == [a.id, b.id, c.id]  # oldest first
    assert lines[0]["trajectory"]["token_ids"] == [5, 6, 7, 10, 11]
    assert lines[0]["trajectory"]["rewards"] == {"user_feedback": 1.0}
    assert [f["value"] for f in lines[0]["feedback"]] == [1.0] and lines[1]["feedback"] == []
    assert [r["served"]["status"] for r in lines] == ["trained", "skipped", "pending"]
    assert lines[0]["created_at"] == T0 - 3 * DAY
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", res.path.name + ".sha256"], cwd=res.path.parent,
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    with service.store.lock:
        assert served_ids(service) == {d.id, e.id} and count(service, "trajectories") == 2
        assert count(service, "rewards") == 0 and count(service, "feedback") == 1  # d's message stays
        row = records.find_response(service.store, "d")
        assert row["parent_id"] is None  # the link to the deleted turn; the record keeps it:
        assert [t.parent_id for t in service.store.trajectories() if t.id == d.id] == [c.id]
    event = [ev for ev in service.store.events() if ev["kind"] == "prune_turns"][-1]
    assert event["data"]["rows"] == 3 and event["data"]["path"] == f"exports/{res.path.name}"
    assert event["data"]["sha256"] == res.sha256
    assert feedback(service, "d", 1.0).updated == 1  # the kept turn takes feedback as before

    assert service.turn_retention.run_pass().rows == 0  # nothing more is old enough
    clock.t = T0 + DAY
    again = service.turn_retention.run_pass()
    assert again.rows == 2 and again.path != res.path and count(service, "trajectories") == 0
    assert service.status()["retention"]["turns_pruned"] == 5


def test_turns_that_may_still_be_trained_stay(make):
    service, clock = make()
    young = T0 - DAY + 60  # a minute inside learner.max_feedback_age_s
    kept = [store_turn(service, "pending", young), store_turn(service, "skipped", young, "skipped"),
            store_turn(service, "queued", young)]
    assert feedback(service, "queued", 1.0).outcome == "used"  # waits for the next update
    assert feedback(service, "skipped", 1.0).outcome in ("used", "queued")  # brought back to pending
    old = store_turn(service, "old", T0 - DAY - 60, "trained", reward=1.0)
    res = service.turn_retention.run_pass()
    assert res.rows == 1 and served_ids(service) == {t.id for t in kept}
    assert [json.loads(line)["id"] for line in res.path.read_text().splitlines()] == [old.id]


def test_the_newest_trained_turn_of_each_family_stays(make, tmp_path):
    from selfrl.config.serve import FamilyConfig

    cfg = config(tmp_path / "run")
    cfg.families = [FamilyConfig(name="math", source="chain_sum")]
    service, clock = make(cfg)
    first = store_turn(service, "m1", T0 - 3 * DAY, "trained", family="math")
    newest = store_turn(service, "m2", T0 - 2 * DAY, "trained", family="math")
    skipped = store_turn(service, "m3", T0 - 2 * DAY + 1, "skipped", family="math")
    other = store_turn(service, "o1", T0 - 2 * DAY, "trained", family="not_configured")
    assert service.turn_retention.run_pass().rows == 3
    assert served_ids(service) == {newest.id}  # first, skipped and other went
    assert records.learned_families(service.store) == {"math"}  # the family still gates every candidate
    assert {first.id, skipped.id, other.id}.isdisjoint({t.id for t in service.store.trajectories()})


ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_the_export_deletes_nothing_and_serving_goes_on(make, monkeypatch, caplog):
    from selfrl.record import retention

    service, clock = make()
    turns = [store_turn(service, f"t{i}", T0 - 2 * DAY, "trained") for i in range(3)]

    def full(fd):
        raise ENOSPC

    monkeypatch.setattr(retention.os, "fsync", full)  # where a full disk fails a write that was buffered
    res = service.turn_retention.run_pass()
    monkeypatch.undo()
    assert res.rows == 0 and "disk that holds" in res.error and "full" in res.error
    assert served_ids(service) == {t.id for t in turns} and count(service, "trajectories") == 3
    assert list((service.run_dir / "exports").iterdir()) == []  # no partial file, no temporary one
    event = [e for e in service.store.events() if e["kind"] == "retention_failed"][-1]
    assert event["data"]["code"] == "disk_full" and "next pass tries again" in event["message"]
    assert "retention deleted no turn" in caplog.text
    assert health(service)[:2] == (200, {"status": "ok", "served_version": 0})
    assert service.status()["retention"]["last_pass"]["error"] == res.error

    assert service.turn_retention.run_pass().rows == 3  # the disk has room again
    assert count(service, "trajectories") == 0


def test_feedback_arriving_during_the_export_deletes_nothing(make, monkeypatch):
    service, clock = make()
    turns = [store_turn(service, f"t{i}", T0 - 2 * DAY, "trained") for i in range(2)]
    real = records.delete_turns

    def late(store, ids, after=None):
        assert feedback(service, "t1", -1.0).outcome == "too_old"  # recorded only, but recorded
        return real(store, ids, after)

    monkeypatch.setattr(records, "delete_turns", late)
    res = service.turn_retention.run_pass()
    monkeypatch.undo()
    assert res.rows == 0 and "feedback reached 1 turn(s)" in res.error
    assert served_ids(service) == {t.id for t in turns} and list((service.run_dir / "exports").iterdir()) == []
    res = service.turn_retention.run_pass()
    lines = [json.loads(line) for line in res.path.read_text().splitlines()]
    assert res.rows == 2 and [f["value"] for f in lines[1]["feedback"]] == [-1.0]  # the late message is exported


def test_a_turn_continuing_a_pruned_one_is_stored_without_the_link(make):
    # a request that continued a conversation whose earlier turn was pruned while it ran
    service, clock = make()
    parent = store_turn(service, "p", T0 - 2 * DAY, "trained")
    assert service.turn_retention.run_pass().rows == 1
    child = store_turn(service, "c", T0, parent=parent.id)  # old code: sqlite3.IntegrityError (FOREIGN KEY)
    assert records.find_response(service.store, "c")["parent_id"] is None
    assert [t.parent_id for t in service.store.trajectories()] == [parent.id] and child.parent_id == parent.id


@pytest.mark.parametrize("max_age_s", [0.0, DAY])
def test_the_learner_prunes_after_an_update_and_a_setting_of_0_keeps_all(make, tmp_path, max_age_s):
    service, clock = make(config(tmp_path / "run", max_age_s=max_age_s))
    assert (service.turn_retention is None) == (max_age_s == 0)
    old = [store_turn(service, f"old{i}", T0 - 2 * DAY, "trained") for i in range(3)]
    for i in range(4):  # ready for the next update: rated +-1 in one group
        store_turn(service, f"new{i}", T0 - 60)
        feedback(service, f"new{i}", (-1.0) ** i)
    assert service.learner.tick()  # one update, then retention
    assert service.learner.last["turns"] == 4
    stored = {t.id for t in service.store.trajectories()}
    exports = tmp_path / "run" / "exports"
    if max_age_s:
        assert stored.isdisjoint(t.id for t in old) and len(stored) == 4
        assert [p.suffix for p in sorted(exports.iterdir())] == [".jsonl", ".sha256"]
    else:
        assert {t.id for t in old} <= stored and len(stored) == 7 and not exports.exists()


def test_the_report_and_health_after_pruning(make, tmp_path):
    service, clock = make()
    for i in range(3):
        store_turn(service, f"old{i}", T0 - 2 * DAY, "trained", reward=1.0)
    store_turn(service, "young", T0 - 60)
    res = service.turn_retention.run_pass()
    assert res.rows == 3
    assert health(service)[:2] == (200, {"status": "ok", "served_version": 0})
    report = write_serve_report(tmp_path / "report", service.store, "serve").read_text()
    assert "## Retention" in report
    assert (f"3 served turns were exported and then deleted from the store, in 1 file(s) (JSONL, each with a "
            "`.sha256` sidecar: `sha256sum -c` checks it) under `exports`") in report
    assert f"Newest export: `exports/{res.path.name}` (3 turns)." in report
    assert "| 1 | 1 | 0 | 0 | 0 | 0 |" in report  # the one turn still stored, pending
    assert (tmp_path / "report" / "plots" / "serve_overview.png").stat().st_size > 0


def test_a_report_without_retention_has_no_retention_section(make, tmp_path):
    service, _ = make(config(tmp_path / "run", max_age_s=0.0))
    store_turn(service, "t", T0)
    assert "## Retention" not in write_serve_report(tmp_path / "report", service.store, "serve").read_text()


@pytest.mark.parametrize("change, message", [
    ({"trajectories_max_age_s": DAY / 2}, "is below learner.max_feedback_age_s = 86400 s: a younger turn may still "
                                          "get feedback and be trained on"),
    ({"trajectories_per_pass": 3}, "retention.trajectories_per_pass = 3 is below learner.max_batch = 4"),
    ({"trajectories_max_age_s": -1.0}, "trajectories_max_age_s must be >= 0"),
    ({"trajectories_per_pass": 0}, "trajectories_per_pass must be >= 1"),
])
def test_settings_that_cannot_be_honoured_are_refused(tmp_path, change, message):
    cfg = config(tmp_path / "run")
    for k, v in change.items():
        setattr(cfg.retention, k, v)
    with pytest.raises(ConfigError, match="retention.") as e:
        cfg.validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_turn_retention_without_a_learner_is_refused(make, tmp_path):
    cfg = config(tmp_path / "run")
    cfg.learner.enabled = False
    with pytest.raises(ConfigError, match="learner.enabled = false: enable the learner, or set "
                                          "retention.trajectories_max_age_s = 0"):
        cfg.validate()
    with pytest.raises(ConfigError, match="this server does not learn \\(--no-learn\\)"):
        make(config(tmp_path / "run2"), learn=False)
    replica = config(tmp_path / "run3", enabled=False)
    replica.replica = True
    replica.validate()  # a replica prunes nothing: its owner prunes the store they share
    assert config(tmp_path / "run4", max_age_s=0.0, enabled=False).validate()  # 0: nothing to refuse


def test_an_export_folder_that_cannot_be_made_is_refused_at_start(make, tmp_path):
    (tmp_path / "a_file").write_text("")
    cfg = config(tmp_path / "run")
    cfg.retention.trajectories_export_dir = str(tmp_path / "a_file" / "exports")
    with pytest.raises(ConfigError, match="retention.trajectories_export_dir: cannot create .*a_file/exports"):
        make(cfg)
    assert not (tmp_path / "run" / "selfrl.db").exists()  # refused before anything started


def test_a_relative_export_folder_is_under_the_run_directory(make, tmp_path):
    cfg = config(tmp_path / "run")
    cfg.retention.trajectories_export_dir = "archive/turns"
    service, _ = make(cfg)
    store_turn(service, "t", T0 - 2 * DAY, "trained")
    res = service.turn_retention.run_pass()
    assert res.path.parent == tmp_path / "run" / "archive" / "turns"


ROOT = Path(__file__).resolve().parents[1]


def test_a_real_full_disk_under_the_export_folder_keeps_every_turn(make, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import fault_serve_disk

    if why := fault_serve_disk.tmpfs_unavailable(tmp_path):
        pytest.skip(f"needs a tmpfs to fill: {why}")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        cfg = config(tmp_path / "run")
        cfg.retention.trajectories_export_dir = str(disk / "exports")
        service, _ = make(cfg)
        for i in range(40):
            store_turn(service, f"t{i}", T0 - 2 * DAY, "trained")
        filler = fault_serve_disk.fill_disk(disk)
        res = service.turn_retention.run_pass()
        assert res.rows == 0 and "full" in res.error and count(service, "trajectories") == 40
        assert list((disk / "exports").iterdir()) == []
        filler.unlink()
        assert service.turn_retention.run_pass().rows == 40 and count(service, "trajectories") == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
