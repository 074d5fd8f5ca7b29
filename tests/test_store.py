import math
import sqlite3

import pytest

from selfrl.record.store import Store
from selfrl.core.trajectory import ToolCallRecord, Trajectory


def make_traj(task_id="t1", **kw) -> Trajectory:
    base = dict(
        task_id=task_id,
        group_id=f"g-{task_id}",
        adapter_version=0,
        prompt_len=2,
        token_ids=[1, 2, 3, 4, 5],
        completion_mask=[0, 0, 1, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -1.25, -0.125],
        messages=[
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
        tool_calls=[
            ToolCallRecord(name="calc", arguments={"expr": "2+3"}, raw='{"name": "calc"}', ok=True, result="5"),
            ToolCallRecord(name="", arguments={}, raw="{bad", ok=False, result="parse error", error="JSONDecodeError"),
        ],
        final_answer="5",
        num_turns=2,
        rewards={"correct": 1.0, "format": 0.5, "tool": None},
        reward=1.5,
        correct=True,
        timings={"generate": 0.25},
    )
    base.update(kw)
    return Trajectory(**base)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "run" / "selfrl.db") as s:
        yield s


def test_wal_and_foreign_keys_on(store, tmp_path):
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    # WAL is a property of the file: a fresh connection sees it too.
    other = sqlite3.connect(tmp_path / "run" / "selfrl.db")
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()


def test_trajectory_round_trip_with_tool_calls(store):
    run = store.start_run({"model": "tiny", "lr": 1e-5})
    t = make_traj()
    store.add_trajectories(run, 3, [t])
    [back] = store.trajectories(run_id=run, iteration=3)
    assert back == t
    assert isinstance(back.tool_calls[0], ToolCallRecord)
    assert back.tool_calls[1].error == "JSONDecodeError"
    assert store.trajectories(run_id=run, iteration=4) == []
    assert store.count_trajectories() == 1
    row = store.conn.execute("SELECT * FROM trajectories").fetchone()
    assert (row["iteration"], row["correct"], row["num_completion_tokens"], row["reward"]) == (3, 1, 3, 1.5)
    rewards = dict(store.conn.execute("SELECT name, value FROM rewards WHERE trajectory_id = ?", (t.id,)).fetchall())
    assert rewards == {"correct": 1.0, "format": 0.5, "tool": None}


def test_non_finite_stored_as_null(store):
    run = store.start_run({"beta": float("nan")})
    t = make_traj(reward=float("nan"), rewards={"x": float("inf")}, logprobs=[0.0, 0.0, -math.inf, -1.0, -1.0])
    store.add_trajectories(run, 0, [t])
    [back] = store.trajectories()
    assert back.reward is None and back.rewards == {"x": None} and back.logprobs[2] is None
    assert store.conn.execute("SELECT reward FROM trajectories").fetchone()[0] is None
    store.log_metrics(run, 0, {"loss": float("nan"), "kl": 0.1})
    assert {m["name"]: m["value"] for m in store.metrics(run)} == {"loss": None, "kl": 0.1}
    assert store.conn.execute("SELECT config_json FROM runs").fetchone()[0] == '{"beta": null}'


def test_broken_second_trajectory_leaves_no_rows(store):
    run = store.start_run({})
    good = make_traj("a")
    unserializable = make_traj("b", timings={"generate": object()})  # json.dumps raises TypeError
    with pytest.raises(TypeError):
        store.add_trajectories(run, 0, [good, unserializable])
    assert store.count_trajectories() == 0
    assert store.conn.execute("SELECT COUNT(*) FROM rewards").fetchone()[0] == 0

    duplicate_id = make_traj("c", id=good.id)
    with pytest.raises(sqlite3.IntegrityError):
        store.add_trajectories(run, 0, [good, duplicate_id])
    assert store.count_trajectories() == 0
    assert store.conn.execute("SELECT COUNT(*) FROM rewards").fetchone()[0] == 0

    with pytest.raises(sqlite3.IntegrityError):  # unknown run id
        store.add_trajectories(run + 100, 0, [good])
    store.add_trajectories(run, 0, [good])  # the store is still usable
    assert store.count_trajectories() == 1


def test_tasks(store):
    store.add_tasks(
        [{"id": "q1", "question": "1+1?", "answer": 2, "source": "arith", "level": 1}, {"id": "q2", "question": "?"}],
        "train",
    )
    store.add_tasks([{"id": "v1", "question": "2+2?", "answer": "4"}], "val")
    assert store.task_ids("train") == {"q1", "q2"}
    assert store.task_ids("val") == {"v1"}
    row = store.conn.execute("SELECT answer, source, metadata_json FROM tasks WHERE id='q1'").fetchone()
    assert tuple(row) == ("2", "arith", '{"level": 1}')
    with pytest.raises(ValueError, match="train, val"):
        store.add_tasks([], "test")
    with pytest.raises(KeyError):  # second task lacks a question: nothing written
        store.add_tasks([{"id": "v2", "question": "x"}, {"id": "v3"}], "val")
    assert store.task_ids("val") == {"v1"}


def test_versions_and_latest_promoted(store):
    assert store.latest_promoted() is None
    assert store.next_version() == 0
    store.add_version(0, None, None, "base")
    assert store.latest_promoted()["version"] == 0
    store.add_version(1, 0, "/ckpt/1", "candidate", {"train/loss": 0.3})
    store.set_version_status(1, "promoted", {"val/success": 0.6})
    store.add_version(2, 1, "/ckpt/2", "candidate")
    store.set_version_status(2, "rejected", {"val/success": 0.4})
    latest = store.latest_promoted()
    assert latest["version"] == 1 and latest["path"] == "/ckpt/1"
    assert latest["metrics"] == {"train/loss": 0.3, "val/success": 0.6}
    assert [v["status"] for v in store.versions()] == ["base", "promoted", "rejected"]
    assert store.next_version() == 3
    with pytest.raises(ValueError, match="rolled_back"):
        store.set_version_status(1, "done")
    with pytest.raises(KeyError):
        store.set_version_status(9, "promoted")
    with pytest.raises(sqlite3.IntegrityError):  # parent 7 does not exist
        store.add_version(3, 7, "/ckpt/3", "candidate")
    with pytest.raises(sqlite3.IntegrityError):  # version exists
        store.add_version(1, 0, "/ckpt/1", "candidate")


def test_evaluations_pair_by_task(store):
    store.add_version(0, None, None, "base")
    store.add_version(1, 0, "/ckpt/1", "promoted")
    store.add_evaluation(0, [("v1", False, "3"), ("v2", True, "4"), ("v3", False, None)])
    store.add_evaluation(1, [("v3", True, "7"), ("v1", True, "2")])
    before, after = store.evaluation(0), store.evaluation(1)
    assert before == {"v1": False, "v2": True, "v3": False}
    shared = sorted(before.keys() & after.keys())
    assert [(before[t], after[t]) for t in shared] == [(False, True), (False, True)]
    store.add_evaluation(1, [("v1", False, "9")])  # re-evaluation replaces
    assert store.evaluation(1)["v1"] is False
    assert store.evaluation(5) == {}
    with pytest.raises(sqlite3.IntegrityError):  # version 5 was never recorded
        store.add_evaluation(5, [("v1", True, "2")])


def test_metrics_events_and_reopen(tmp_path):
    path = tmp_path / "s.db"
    with Store(path) as s:
        run = s.start_run({"a": 1})
        s.log_metrics(run, 1, {"reward/mean": 0.5})
        s.log_metrics(run, 0, {"reward/mean": 0.25, "kl": 0.0})
        s.log_event(run, "promote", "version 1 promoted", {"version": 1})
        s.log_event(None, "note", "no run")
    with Store(path) as s:  # everything was committed
        assert [(m["step"], m["name"], m["value"]) for m in s.metrics(run)] == [
            (0, "reward/mean", 0.25),
            (0, "kl", 0.0),
            (1, "reward/mean", 0.5),
        ]
        assert s.metrics(run + 1) == []
        ev = s.events(run)
        assert len(ev) == 1 and ev[0]["kind"] == "promote" and ev[0]["data"] == {"version": 1}
        assert len(s.events()) == 2
        assert s.start_run({}) == run + 1
