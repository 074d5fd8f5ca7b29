"""Retention of adapter versions and old trajectories (selfrl.record.retention), on hand-built ledgers."""

import hashlib
import json

import pytest

from selfrl.record.retention import VersionRow, export_then_prune, prune_versions, verify_export, versions_to_remove


def row(v, status, path="auto"):
    return VersionRow(v, status, f"adapters/v{v:06d}" if path == "auto" else path)


LEDGER = [row(0, "base"), row(1, "rejected"), row(2, "promoted"), row(3, "rolled_back"), row(4, "candidate"),
          row(5, "rejected"), row(6, "promoted"), row(7, "candidate")]


def test_keep_newest_promoted_and_base():
    assert versions_to_remove(LEDGER, keep_newest=2) == [1, 3, 4, 5]
    assert versions_to_remove(LEDGER, keep_newest=4) == [1, 3]
    assert versions_to_remove(LEDGER, keep_newest=100) == []


def test_pinned_old_version_and_served_are_kept():
    assert versions_to_remove(LEDGER, keep_newest=2, pinned=[1]) == [3, 4, 5]
    assert versions_to_remove(LEDGER, keep_newest=2, served=3) == [1, 4, 5]  # an admin rolled back to 3


def test_all_promoted_removes_nothing():
    rows = [row(0, "base")] + [row(v, "promoted") for v in range(1, 6)]
    assert versions_to_remove(rows, keep_newest=1) == []


def test_keep_promoted_bounds_the_promoted_versions_kept():
    rows = [row(0, "base")] + [row(v, "promoted") for v in range(1, 8)] + [row(8, "rejected")]
    # the newest 3 promoted (5, 6, 7), the newest version (8), the base, a pinned champion (2)
    assert versions_to_remove(rows, keep_newest=1, keep_promoted=3, pinned=[2]) == [1, 3, 4]
    assert versions_to_remove(rows, keep_newest=1, keep_promoted=3, served=1) == [2, 3, 4]
    assert versions_to_remove(rows, keep_newest=1, keep_promoted=0) == []  # 0: every promoted one
    with pytest.raises(ValueError, match="keep_promoted must be >= 0"):
        versions_to_remove(rows, keep_newest=1, keep_promoted=-1)


def test_folder_shared_with_a_kept_row_stays():
    rows = [row(0, "base"), row(1, "rejected", "adapters/v000002"), row(2, "promoted"), row(3, "rejected"),
            row(4, "candidate", None), row(5, "candidate")]
    # 1 shares 2's folder; 4 has no folder: neither is listed
    assert versions_to_remove(rows, keep_newest=1) == [3]


def test_refused_inputs():
    with pytest.raises(ValueError, match="keep_newest must be >= 1"):
        versions_to_remove(LEDGER, keep_newest=0)
    with pytest.raises(ValueError, match=r"\[42\]"):
        versions_to_remove(LEDGER, keep_newest=1, pinned=[42])
    with pytest.raises(ValueError, match=r"\[9\]"):
        versions_to_remove(LEDGER, keep_newest=1, served=9)
    with pytest.raises(ValueError, match="duplicate"):
        versions_to_remove([row(1, "base"), row(1, "promoted")], keep_newest=1)


def make_run(tmp_path, rows):
    for r in rows:
        if r.path:
            d = tmp_path / r.path
            d.mkdir(parents=True, exist_ok=True)
            (d / "adapter.safetensors").write_bytes(b"w%d" % r.version)
    return tmp_path


def test_prune_moves_marks_then_deletes(tmp_path):
    run = make_run(tmp_path, LEDGER)
    marked = []
    moved = prune_versions(run, LEDGER, versions_to_remove(LEDGER, keep_newest=2), marked.append)
    assert marked == [1, 3, 4, 5]
    assert [p.name for p in moved] == ["v000001", "v000003", "v000004", "v000005"]
    assert (run / "adapters/.pruned/v000003/adapter.safetensors").read_bytes() == b"w3"
    assert sorted(p.name for p in (run / "adapters").iterdir()) == [".pruned", "v000000", "v000002", "v000006",
                                                                    "v000007"]
    # deleting: the folder leaves .pruned too
    rows = LEDGER + [row(8, "rejected"), row(9, "candidate")]
    make_run(tmp_path, rows[-2:])
    prune_versions(run, rows, [8], marked.append, delete=True)
    assert marked[-1] == 8 and not (run / "adapters/.pruned/v000008").exists()


def test_prune_failing_mark_moves_the_folder_back(tmp_path):
    run = make_run(tmp_path, LEDGER)

    def mark(v):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        prune_versions(run, LEDGER, [1], mark)
    assert (run / "adapters/v000001/adapter.safetensors").read_bytes() == b"w1"


def test_prune_refuses_a_path_outside_the_adapters_folder_before_moving_anything(tmp_path):
    rows = [row(1, "rejected"), row(2, "rejected", "store.db")]
    run = make_run(tmp_path, rows[:1])
    with pytest.raises(ValueError, match="not a version folder"):
        prune_versions(run, rows, [1, 2], lambda v: None)
    assert (run / "adapters/v000001").is_dir()
    with pytest.raises(ValueError, match="no folder"):
        prune_versions(run, [row(3, "rejected", None)], [3], lambda v: None)


def test_prune_folder_already_gone_is_only_marked(tmp_path):
    marked = []
    assert prune_versions(tmp_path, [row(1, "rejected")], [1], marked.append) == []
    assert marked == [1]


TRAJS = [{"id": 1, "created_at": 10.0, "reward": 1.0}, {"id": 2, "created_at": 20.0, "reward": 0.0},
         {"id": 3, "created_at": 30.0, "reward": 0.5}]


def test_export_then_prune(tmp_path):
    deleted = []
    out = tmp_path / "trajectories-before-25.jsonl"
    res = export_then_prune(iter(TRAJS), 25.0, out, lambda ids: deleted.extend(ids) or len(ids))
    want = b'{"created_at": 10.0, "id": 1, "reward": 1.0}\n{"created_at": 20.0, "id": 2, "reward": 0.0}\n'
    assert out.read_bytes() == want
    assert res.sha256 == hashlib.sha256(want).hexdigest() and (res.rows, res.deleted) == (2, 2)
    assert (tmp_path / "trajectories-before-25.jsonl.sha256").read_text() == \
        f"{res.sha256}  trajectories-before-25.jsonl\n"
    assert deleted == [1, 2] and verify_export(out) == 2
    with pytest.raises(FileExistsError):
        export_then_prune(TRAJS, 25.0, out, lambda ids: len(ids))


def test_export_damaged_file_detected(tmp_path):
    out = tmp_path / "t.jsonl"
    export_then_prune(TRAJS, 100.0, out, lambda ids: len(ids))
    out.write_bytes(out.read_bytes().replace(b"0.5", b"0.6"))
    with pytest.raises(ValueError, match="damaged"):
        verify_export(out)


def test_export_nothing_old_enough_writes_nothing(tmp_path):
    res = export_then_prune(TRAJS, 5.0, tmp_path / "t.jsonl", lambda ids: pytest.fail("nothing to delete"))
    assert (res.path, res.rows, res.deleted) == (None, 0, 0) and list(tmp_path.iterdir()) == []


def test_export_delete_count_mismatch_keeps_the_file(tmp_path):
    out = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError, match="1 rows deleted of 2"):
        export_then_prune(TRAJS, 25.0, out, lambda ids: 1)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2]


def test_export_row_without_time_refused(tmp_path):
    with pytest.raises(ValueError, match="lacks 'created_at'"):
        export_then_prune([{"id": 1}], 25.0, tmp_path / "t.jsonl", lambda ids: len(ids))
    assert list(tmp_path.iterdir()) == []


def test_serve_prunes_after_an_update_and_never_offers_a_pruned_version(tiny_tokenizer, tiny_model_factory, tmp_path):
    # before: every candidate's folder stayed for ever
    import copy

    from selfrl.record.adapters import lora_state
    from selfrl.serve.errors import ApiError
    from selfrl.serve.service import Service
    from serving import add_version, tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run")
    cfg.retention.keep_newest = 1
    cfg.learner.max_feedback_age_versions = 0  # no late judgement needs an older version's weights
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        state = lora_state(model)
        for v, status in [(1, "promoted"), (2, "rolled_back"), (3, "rejected"), (4, "candidate")]:
            add_version(service, state, v, parent=0, status=status)
        assert service.prune_versions() == [2, 3]  # 0 base, 1 promoted, 4 the newest
        adapters_dir = tmp_path / "run" / "adapters"
        assert sorted(p.name for p in (adapters_dir / ".pruned").iterdir()) == ["v000002", "v000003"]
        assert not (adapters_dir / "v000002").exists() and (adapters_dir / "v000004").exists()
        events = [e for e in service.store.events() if e["kind"] == "prune"]
        assert [e["data"]["version"] for e in events] == [2, 3] and "moved to adapters/.pruned" in events[0]["message"]
        assert [v["version"] for v in service.version_ids()] == [0, 1]
        with pytest.raises(ApiError, match="pruned by retention"):
            service.rollback(2)  # a rolled-back version could be rolled back to, until it was pruned
        assert service.prune_versions() == []  # nothing more to prune: already marked
        cfg.retention.delete = True
        add_version(service, state, 5, parent=0, status="rejected")
        assert service.prune_versions() == [4]  # 5 is now the newest
        assert not (adapters_dir / "v000004").exists() and not (adapters_dir / ".pruned" / "v000004").exists()
    finally:
        service.close()


def test_serve_keeps_the_newest_promoted_versions_and_the_champion(tiny_tokenizer, tiny_model_factory, tmp_path):
    # before: every promoted version's folder stayed for ever (the soak's disk filled with them)
    import copy

    from selfrl.config import ConfigError
    from selfrl.record.adapters import lora_state
    from selfrl.serve.service import Service
    from serving import add_version, tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run")
    cfg.retention.keep_newest, cfg.retention.keep_promoted = 1, 2
    cfg.learner.max_feedback_age_versions = 0  # no late judgement needs an older version's weights
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        state = lora_state(model)
        for v in range(1, 6):
            add_version(service, state, v, parent=v - 1, status="promoted", metrics={"val/success": 0.5})
        champion = service.ledger.champion.version
        kept = {0, 4, 5, champion}
        assert service.prune_versions() == sorted({1, 2, 3} - {champion})
        assert {v["version"] for v in service.version_ids()} == kept
    finally:
        service.close()
    cfg.retention.keep_newest = 0
    with pytest.raises(ConfigError, match="keep_promoted applies only with keep_newest"):
        cfg.validate()


def test_serve_keeps_the_versions_a_late_judgement_is_weighed_by(tiny_tokenizer, tiny_model_factory, tmp_path):
    # before: keep_newest/keep_promoted pruned versions whose turns the age rule still trains on;
    # a late judgement of such a turn was then weighed 0 and the update skipped as "no group had
    # reward spread" (a 90-minute soak lost most of its rated turns so)
    import copy

    from selfrl.core.trajectory import Trajectory
    from selfrl.record import served as records
    from selfrl.record.adapters import lora_state
    from selfrl.serve.service import Service
    from serving import add_version, tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run")
    cfg.retention.keep_newest, cfg.retention.keep_promoted = 1, 1
    cfg.learner.max_feedback_age_versions = 3
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))

    def turn(version: int, status: str) -> None:
        t = Trajectory("t", "t", version, prompt_len=3, token_ids=[5, 6, 7, 10], completion_mask=[0, 0, 0, 1],
                       logprobs=[0.0] * 4)
        with service.store.lock:
            records.add_turn(service.store, service.run_id, t, t.id, 0, t.id, "g", t.id)
            if status != "pending":
                records.mark(service.store, [t], status, None)

    try:
        state = lora_state(model)
        for v in range(1, 7):  # weights 0 -> 1 -> ... -> 6, the champion
            add_version(service, state, v, parent=v - 1, status="promoted", metrics={"val/success": 0.1 * v})
        service.ledger.set_champion(6, state)
        turn(2, "pending")  # 4 weight changes back: past the cutoff, its folder may go
        turn(4, "pending")  # 2 back: a judgement may still come
        turn(5, "trained")  # 1 back, but trained: no judgement can train it again
        turn(5, "trained")
        assert service.prune_versions() == [1, 2, 3, 5]  # 0 base, 6 newest and promoted, 4 still needed
        assert {v["version"] for v in service.version_ids()} == {0, 4, 6}
        turn(6, "skipped")  # skipped for want of a reward: a late judgement brings it back
        cfg.learner.max_feedback_age_versions = 0
        assert service.prune_versions() == [4]
        add_version(service, state, 7, parent=6, status="rejected")  # never served: no turn of it
        add_version(service, state, 8, parent=6, status="candidate")
        cfg.learner.max_feedback_age_versions = 4
        assert service.prune_versions() == [7]
    finally:
        service.close()


def test_export_that_cannot_be_written_leaves_nothing_and_deletes_nothing(tmp_path, monkeypatch):
    # a full disk fails the write at fsync; old code left the temporary file behind
    import errno

    from selfrl.record import retention

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(retention.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        export_then_prune(TRAJS, 25.0, tmp_path / "t.jsonl", lambda ids: pytest.fail("nothing may be deleted"))
    assert list(tmp_path.iterdir()) == []


def test_export_whose_sidecar_cannot_be_written_is_removed(tmp_path, monkeypatch):
    from selfrl.record import retention

    calls = []

    def fsync_once(fd):  # the export's own fsync passes; the sidecar's fails
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(retention.os, "fsync", fsync_once)
    with pytest.raises(OSError):
        export_then_prune(TRAJS, 25.0, tmp_path / "t.jsonl", lambda ids: pytest.fail("nothing may be deleted"))
    assert list(tmp_path.iterdir()) == []
