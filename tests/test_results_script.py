"""``scripts/results.py``: the table pairs RL with the base and the best prompt on the same
held-out tasks (numbers computed by hand below), refuses a prompt measured on other tasks or a
held-out task that was trained on, and a second ``run`` skips every finished step (an
interrupted RL run continues with ``--resume``)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.record.store import Store

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("results_script", ROOT / "scripts" / "results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["results_script"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


results = load_script()

TASKS = ["t1", "t2", "t3", "t4", "t5"]
BASE = [False, False, True, True, False]  # 2/5
RL = [True, False, True, True, True]  # 4/5
PROMPTS = {
    0: [False, True, False, True, False],  # 2/5
    3: [True, False, True, True, False],  # 3/5: the best
    5: [True, True, True, False, False],  # 3/5: a tie, the smaller k wins
}


ROLLOUT_S, UPDATE_S = (4.0, 6.0), (1.0, 2.0)  # seconds of iterations 0 and 1
VALIDATION_S = 3.5  # seconds of the base's validation


def write_run(run_dir: Path, rl: list[bool] | None, trained: tuple[str, ...] = ("x1", "x2"), rule: str = "newest",
              done: int = 2, warm_start: bool = False):
    """A run's store: base evaluated (in :data:`VALIDATION_S`); version 1 promoted with ``rl``
    (None: nothing promoted); ``done`` of its 2 iterations logged their update (2: a finished
    run), with the seconds of :data:`ROLLOUT_S` and :data:`UPDATE_S`; ``warm_start`` on in its config."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"iterations": 2, "gate": {"rule": rule, "tolerance": 0.0},
                                                     "warm_start": {"enabled": warm_start}}))
    with Store(run_dir / "selfrl.db") as store:
        run = store.start_run({})
        store.log_metrics(run, 0, {"time/validation_s": VALIDATION_S})
        for step in range(done):
            store.log_metrics(run, step, {"reward/mean": 0.5, "time/rollout_s": ROLLOUT_S[step],
                                          "time/update_s": UPDATE_S[step]})
        store.add_trajectories(run, 0, [Trajectory(t, t, 0) for t in trained])
        store.add_version(0, None, None, "base", {"val/success": sum(BASE) / len(BASE)})
        store.add_evaluation(0, [(t, ok, None) for t, ok in zip(TASKS, BASE)])
        if rl is not None:
            store.add_version(1, 0, None, "promoted", {"val/success": sum(rl) / len(rl)})
            store.add_evaluation(1, [(t, ok, None) for t, ok in zip(TASKS, rl)])


def write_prompts(folder: Path, tasks=TASKS):
    for k, solved in PROMPTS.items():
        (folder / f"prompt-k{k}.json").write_text(json.dumps({str(k): dict(zip(tasks, solved))}))


@pytest.fixture
def tiny_env(monkeypatch):
    monkeypatch.setattr(results, "ENVIRONMENTS", {"tiny": results.Environment("configs/demo.toml", (0, 3, 5))})


def test_the_table_pairs_rl_with_the_base_and_the_best_prompt(tmp_path, tiny_env):
    write_run(tmp_path / "tiny" / "seed0", RL)
    write_run(tmp_path / "tiny" / "seed1", None)  # nothing promoted: RL serves the base
    write_prompts(tmp_path / "tiny")
    path = results.write_table(["tiny"], [0, 1], tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())
    r0, r1 = rows
    assert (r0["seed"], r0["held_out"], r0["base"]["successes"], r0["rl"]["successes"]) == (0, 5, 2, 4)
    assert r0["rl"]["version"] == 1 and r0["rl"]["promoted"]
    assert r0["best_prompt"]["shots"] == 3 and r0["best_prompt"]["successes"] == 3
    # RL - base: d = [1, 0, 0, 0, 1], mean 0.4, s^2 = (2 x 0.36 + 3 x 0.16) / 4 = 0.3,
    # half = 1.96 sqrt(0.3 / 5) = 0.48010
    assert r0["rl_minus_base"] == pytest.approx({"diff": 0.4, "low": -0.08010, "high": 0.88010}, abs=1e-5)
    # RL - k=3: d = [0, 0, 0, 0, 1], mean 0.2, s^2 = (4 x 0.04 + 0.64) / 4 = 0.2, half = 1.96 x 0.2 = 0.392
    assert r0["rl_minus_best_prompt"] == pytest.approx({"diff": 0.2, "low": -0.192, "high": 0.592}, abs=1e-9)
    assert r0["beats_best_prompt"] is False
    # seed 1 serves the base: RL - base is 0 exactly; RL - k=3: d = [-1, 0, 0, 0, 0]
    assert r1["rl"] == {**r1["base"], "version": 0, "promoted": False}
    assert r1["rl_minus_base"] == {"diff": 0.0, "low": 0.0, "high": 0.0}
    assert r1["rl_minus_best_prompt"] == pytest.approx({"diff": -0.2, "low": -0.592, "high": 0.192}, abs=1e-9)
    text = path.read_text()
    # 4/5: Wilson [0.376, 0.964] (tests/test_report.py); 3/5: [0.231, 0.882]
    assert "| tiny | 0 | 5 | 2/5 = 40.0% [11.8%, 76.9%] | 3/5 = 60.0% [23.1%, 88.2%] (k = 3) " \
           "| 4/5 = 80.0% [37.6%, 96.4%] (v1) | +40.0 [-8.0, +88.0] | +20.0 [-19.2, +59.2] | no |" in text
    assert "(the base: nothing promoted) | +0.0 [+0.0, +0.0] | -20.0 [-59.2, +19.2] | no |" in text
    assert "- tiny: RL beats the best prompt in 0 of 2 seeds." in text
    # the cost: 2 stored trajectories; (4 + 6 + 1 + 2) / (4 + 6) = 1.3
    assert r0["rollouts"] == {"rl": 2, "warm_start": None} and r0["warm_start"] is None
    assert r0["cost_ratio"] == pytest.approx(1.3)
    assert r0["cost_s"] == pytest.approx({"rollout": 10.0, "update": 3.0, "validation": 3.5, "warm_start": None})
    assert "| +20.0 [-19.2, +59.2] | no |  | 2 | 1.30 |  |" in text  # no ledger: no wall times
    assert "| tiny | 0 | 2 | 2 | 10.0 s | 3.0 s | 3.5 s | off | 1.30 |" in text


TRAINED = {"phase": "trained", "version": 1, "parent": 0, "tasks": 16, "samples": 64, "kept": 5, "train_seconds": 30.0}
WARM_STARTS = {  # the warm_start events a run records (selfrl.run.warm_start) -> (status, samples, seconds)
    "none yet": ([], ("not recorded", None, None)),
    "gated": ([TRAINED, {**TRAINED, "phase": "done", "outcome": "promoted", "seconds": 42.0}], ("promoted", 64, 30.0)),
    "not yet gated": ([TRAINED], ("not yet gated", 64, 30.0)),
    "no success": ([{"phase": "no_successes", "outcome": "no_successes", "tasks": 16, "samples": 64, "kept": 0,
                     "seconds": 12.0}], ("no_successes", 64, 12.0)),
}


@pytest.mark.parametrize("case", WARM_STARTS)
def test_the_warm_start_s_samples_and_seconds_come_from_its_last_event(tmp_path, tiny_env, case):
    """Its seconds are sampling and fine-tuning ("train_seconds"; the gate's validation is counted
    under validation), or "seconds" when no candidate was made; none recorded: none invented.
    The cost ratio stays over the RL iterations."""
    events, (status, samples, seconds) = WARM_STARTS[case]
    write_run(tmp_path / "tiny" / "seed0", RL, warm_start=True)
    with Store(tmp_path / "tiny" / "seed0" / "selfrl.db") as store:
        for data in events:
            store.log_event(1, "warm_start", "warm start: ...", data)
    write_prompts(tmp_path / "tiny")
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert (row["warm_start"], row["rollouts"], row["cost_s"]["warm_start"]) == \
        (status, {"rl": 2, "warm_start": samples}, seconds)
    assert row["cost_ratio"] == pytest.approx(1.3)
    text = results.markdown([row])
    if samples is None:
        assert "| 2 + warm start not recorded | 1.30 |" in text
        assert "| 3.5 s | not recorded | 1.30 |" in text
    else:
        assert "| 2 + 64 warm start | 1.30 |" in text
        assert f"| 3.5 s | 64 samples, {seconds:.1f} s ({status}) | 1.30 |" in text


def test_the_served_version_follows_the_gate_rule(tmp_path, tiny_env):
    """gate.rule = "best" serves the higher of two promoted versions, not the newest."""
    write_run(tmp_path / "tiny" / "seed0", RL, rule="best")
    with Store(tmp_path / "tiny" / "seed0" / "selfrl.db") as store:
        store.add_version(2, 1, None, "promoted", {"val/success": 0.2})
        store.add_evaluation(2, [(t, t == "t1", None) for t in TASKS])
    write_prompts(tmp_path / "tiny")
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert row["rl"]["version"] == 1 and row["rl"]["successes"] == 4


def test_a_prompt_measured_on_other_tasks_is_refused(tmp_path, tiny_env):
    write_run(tmp_path / "tiny" / "seed0", RL)
    write_prompts(tmp_path / "tiny", tasks=["t1", "t2", "t3", "t4", "other"])
    with pytest.raises(ValueError, match=r"prompt-k0.json: its 5 tasks are not .*seed0's 5 held-out tasks "
                                         r"\(1 not held out there, 1 missing\)"):
        results.table_rows(["tiny"], [0], tmp_path)
    assert results.main(["table", "--envs", "tiny", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "results.md").exists()


def test_a_file_that_is_not_json_is_named_with_what_to_do(tmp_path, tiny_env, capsys):
    write_run(tmp_path / "tiny" / "seed0", RL)
    write_prompts(tmp_path / "tiny")
    (tmp_path / "tiny" / "prompt-k3.json").write_text('{"3": {"t1": tru')  # a write cut short
    assert results.main(["table", "--envs", "tiny", "--seeds", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tiny' / 'prompt-k3.json'} is not JSON (" in err and "delete it and rerun" in err
    (tmp_path / "steps.json").write_text("{")
    with pytest.raises(ValueError, match=r"steps.json is not JSON \(.*\): delete it to run every step again"):
        results.read_ledger(tmp_path)
    for bad in (b"\xff", b"[]", b"null", b'{"seed0": 5}'):  # not UTF-8, or JSON of another shape
        (tmp_path / "steps.json").write_bytes(bad)
        with pytest.raises(ValueError, match=r"steps.json is (not JSON \(.*\)|JSON but not .*): delete it to run every step again"):
            results.read_ledger(tmp_path)
    for bad in ('[1, 2]', '{"3": 5}', '{"three": {"t1": true}}', '{"3": {"t1": 1}}'):
        (tmp_path / "tiny" / "prompt-k3.json").write_text(bad)
        with pytest.raises(ValueError, match=r"prompt-k3.json is JSON but not .*: delete it and rerun"):
            results.read_prompts(tmp_path / "tiny", set(TASKS), "seed0")


def test_a_held_out_task_that_was_trained_on_is_refused(tmp_path, tiny_env):
    write_run(tmp_path / "tiny" / "seed0", RL, trained=("x1", "t4"))
    write_prompts(tmp_path / "tiny")
    with pytest.raises(ValueError, match="1 held-out tasks were also trained on \\(e.g. t4\\)"):
        results.table_rows(["tiny"], [0], tmp_path)


def test_an_unknown_environment_is_refused_before_anything_runs(tmp_path, tiny_env):
    calls = []
    with pytest.raises(ValueError, match="unknown environment 'nope'; valid: tiny"):
        results.run_all(["tiny", "nope"], [0], tmp_path, runner=calls.append)
    assert calls == []


def test_a_second_run_skips_what_is_finished_and_resumes_what_is_not(tmp_path, tiny_env):
    calls, fail = [], {"seed1"}

    def runner(argv):
        calls.append(argv)
        if "--per-task" in argv:
            Path(argv[argv.index("--per-task") + 1]).write_text("{}")
            return 0
        run_dir = Path(argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else argv[argv.index("--resume") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "selfrl.db").write_text("")
        return 1 if run_dir.name in fail else 0

    assert results.run_all(["tiny"], [0, 1], tmp_path, runner) == 1  # seed 1 fails
    assert [a[a.index("--shots") + 1] if "--shots" in a else a[a.index("--seed") + 1] for a in calls] == \
        ["0", "3", "5", "0", "1"]
    ledger = json.loads((tmp_path / "tiny" / "steps.json").read_text())
    assert {s: e["finished"] for s, e in ledger.items()} == \
        {"prompt-k0": True, "prompt-k3": True, "prompt-k5": True, "seed0": True, "seed1": False}
    assert ledger["seed0"]["command"] == f"selfrl run --config configs/demo.toml --seed 0 --run-dir {tmp_path}/tiny/seed0"
    assert ledger["prompt-k3"]["command"] == \
        f"python scripts/prompt_baseline.py --config configs/demo.toml --shots 3 --per-task {tmp_path}/tiny/prompt-k3.json"

    calls.clear()
    fail.clear()
    assert results.run_all(["tiny"], [0, 1], tmp_path, runner) == 0
    assert [a[1:] for a in calls] == [["run", "--resume", str(tmp_path / "tiny" / "seed1")]]  # only the unfinished
    ledger = json.loads((tmp_path / "tiny" / "steps.json").read_text())
    assert ledger["seed1"]["finished"] and ledger["seed1"]["attempts"] == 2

    calls.clear()
    assert results.run_all(["tiny"], [0, 1], tmp_path, runner) == 0
    assert calls == []
    (tmp_path / "tiny" / "prompt-k5.json").unlink()  # a finished step whose output is gone runs again
    assert results.run_all(["tiny"], [0, 1], tmp_path, runner) == 0
    assert len(calls) == 1 and calls[0][calls[0].index("--shots") + 1] == "5"


def test_the_code_a_step_ran_on_is_its_commit_and_whether_tracked_files_differed(tmp_path, monkeypatch):
    import subprocess

    def commit(repo: Path) -> str:
        git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        subprocess.run([*git, "init", "-q"], check=True, env=clean)
        (repo / "a.py").write_text("x = 1\n")
        subprocess.run([*git, "add", "a.py"], check=True, env=clean)
        subprocess.run([*git, "commit", "-qm", "a"], check=True, env=clean)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              env=clean).stdout.strip()

    other = tmp_path / "other"  # the repository GIT_DIR names: before, its commit was reported for any folder
    other.mkdir()
    commit(other)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    tmp_path = tmp_path / "repo"
    tmp_path.mkdir()

    assert results.code_version(tmp_path) == "unknown (not a git checkout)"
    head = commit(tmp_path)
    assert results.code_version(tmp_path) == head[:12]
    (tmp_path / "new.txt").write_text("an untracked file changes no code")
    assert results.code_version(tmp_path) == head[:12]
    (tmp_path / "a.py").write_text("x = 2\n")
    assert results.code_version(tmp_path) == f"{head[:12]} with uncommitted changes"
    (tmp_path / "sub").mkdir()  # a folder inside a checkout is not one: it would name the outer commit
    assert results.code_version(tmp_path / "sub") == "unknown (not a git checkout)"


def test_the_table_names_the_code_of_every_step(tmp_path, tiny_env):
    folder = tmp_path / "tiny"
    write_run(folder / "seed0", RL)
    write_run(folder / "seed1", RL)
    write_prompts(folder)
    for k in (0, 3, 5):
        results.record_step(folder, f"prompt-k{k}", f"prompt {k}", 1.0, True, "aaaa")
    results.record_step(folder, "seed0", "run 0", 5.0, True, "aaaa")
    results.record_step(folder, "seed1", "run 1", 5.0, False, "aaaa")
    assert results.write_table(["tiny"], [0, 1], tmp_path).read_text().endswith(
        "## Code\n\nEvery step ran on commit `aaaa`.\n")
    results.record_step(folder, "seed1", "run 1", 7.0, True, "bbbb")  # resumed on other code
    results.record_step(folder, "seed1", "run 1", 1.0, True, "aaaa")  # and back: listed once
    entry = results.read_ledger(folder)["seed1"]
    assert (entry["code"], entry["attempts"], entry["wall_s"]) == (["aaaa", "bbbb"], 3, 13.0)
    text = results.write_table(["tiny"], [0, 1], tmp_path).read_text()
    assert text.endswith("## Code\n\n- tiny prompt k = 0: `aaaa`\n- tiny prompt k = 3: `aaaa`\n"
                         "- tiny prompt k = 5: `aaaa`\n- tiny seed 0: `aaaa`\n- tiny seed 1: `aaaa`, `bbbb`\n")
    rows = json.loads((tmp_path / "results.json").read_text())
    assert rows[1]["code"] == {"rl": ["aaaa", "bbbb"], "prompts": {"0": ["aaaa"], "3": ["aaaa"], "5": ["aaaa"]}}


def test_a_table_of_steps_recorded_without_their_code_says_so(tmp_path, tiny_env):
    write_run(tmp_path / "tiny" / "seed0", RL)
    write_prompts(tmp_path / "tiny")
    text = results.write_table(["tiny"], [0], tmp_path).read_text()  # no ledger at all
    assert "- tiny seed 0: not recorded\n" in text and "- tiny prompt k = 3: not recorded\n" in text


def test_a_tiny_model_end_to_end(tmp_path, model_dir, monkeypatch):
    """The real steps on a tiny model: the prompt baseline and the run agree on the held-out
    tasks (else the table refuses), and the table pairs them; the run's rollouts, the warm
    start's samples and the seconds are those its store holds."""
    config = tmp_path / "tiny.toml"
    config.write_text(f"""
iterations = 1
num_prompts = 2
num_generations = 2
[model]
name = "{model_dir}"
device = "cpu"
[lora]
r = 2
[task]
source = "arithmetic"
num_train = 20
[rollout]
max_new_tokens = 6
max_turns = 1
[gate]
val_size = 6
[warm_start]
enabled = true
num_tasks = 3
samples_per_task = 2
""")
    monkeypatch.setattr(results, "ENVIRONMENTS", {"tiny": results.Environment(str(config), (0, 1))})
    out = tmp_path / "out"
    assert results.main(["run", "--envs", "tiny", "--seeds", "0", "--out", str(out)]) == 0
    assert results.main(["table", "--envs", "tiny", "--seeds", "0", "--out", str(out)]) == 0
    (row,) = json.loads((out / "results.json").read_text())
    assert row["held_out"] == 6 and set(row["prompts"]) == {"0", "1"}
    assert row["best_prompt"]["shots"] in (0, 1) and row["wall_s"]["rl"] > 0
    assert row["commands"]["rl"] == f"selfrl run --config {config} --seed 0 --run-dir {out}/tiny/seed0"
    # 1 iteration x 2 prompts x 2 generations; the warm start's 3 tasks x 2 samples
    assert row["rollouts"] == {"rl": 1 * 2 * 2, "warm_start": 3 * 2}
    with Store(out / "tiny" / "seed0" / "selfrl.db", readonly=True) as store:
        totals: dict[str, float] = {}
        for m in store.metrics():
            totals[m["name"]] = totals.get(m["name"], 0.0) + (m["value"] or 0.0)
        (warm,) = [e["data"] for e in store.events() if e["kind"] == "warm_start" and e["data"]["phase"] != "trained"]
    inference, training = totals["time/rollout_s"], totals.get("time/update_s", 0.0)
    assert inference > 0
    assert row["cost_ratio"] == pytest.approx((inference + training) / inference)
    assert row["cost_s"] == pytest.approx({"rollout": inference, "update": training,
                                           "validation": totals["time/validation_s"],
                                           "warm_start": warm.get("train_seconds", warm["seconds"])})
    assert row["warm_start"] == warm["outcome"] and row["cost_s"]["warm_start"] > 0
    text = (out / "results.md").read_text()
    assert f"| 4 + 6 warm start | {(inference + training) / inference:.2f} |" in text


def test_a_seed_whose_interval_is_above_zero_beats_the_best_prompt(tmp_path, tiny_env, monkeypatch):
    """Every prompt fails the 5 tasks and RL solves them all: d = 1 on each, the interval [+1, +1]."""
    monkeypatch.setattr(sys.modules[__name__], "BASE", [False] * 5)
    monkeypatch.setattr(sys.modules[__name__], "PROMPTS", {0: [False] * 5, 3: [False, False, False, False, True]})
    write_run(tmp_path / "tiny" / "seed0", [True] * 5)
    write_prompts(tmp_path / "tiny")
    text = results.write_table(["tiny"], [0], tmp_path).read_text()
    assert "(k = 3) | 5/5 = 100.0% [56.6%, 100.0%] (v1) | +100.0 [+100.0, +100.0] | +80.0 [+40.8, +100.0] | yes |" in text
    assert "- tiny: RL beats the best prompt in 1 of 1 seeds." in text


def test_an_unfinished_seed_is_marked_and_left_out_of_the_count(tmp_path, tiny_env, monkeypatch, capsys):
    """Seed 1 was killed after 1 of its 2 iterations: its row says so instead of a verdict, and
    the count is over the finished seed alone (seed 1 would beat the prompt, so counting it shows)."""
    monkeypatch.setattr(sys.modules[__name__], "BASE", [False] * 5)
    monkeypatch.setattr(sys.modules[__name__], "PROMPTS", {0: [False] * 5, 3: [False, False, False, False, True]})
    write_run(tmp_path / "tiny" / "seed0", None)
    write_run(tmp_path / "tiny" / "seed1", [True] * 5, done=1)
    write_prompts(tmp_path / "tiny")
    assert results.main(["table", "--envs", "tiny", "--seeds", "0", "1", "--out", str(tmp_path)]) == 0
    r0, r1 = json.loads((tmp_path / "results.json").read_text())
    assert (r0["finished"], r0["status"], r0["iterations"], r0["beats_best_prompt"]) == \
        (True, "finished", {"done": 2, "of": 2}, False)
    assert (r1["finished"], r1["status"], r1["iterations"], r1["beats_best_prompt"]) == \
        (False, "unfinished: iteration 1 of 2", {"done": 1, "of": 2}, None)
    assert r1["rl_minus_best_prompt"]["low"] > 0  # what it has so far is kept, not counted
    text = (tmp_path / "results.md").read_text()
    assert "| +80.0 [+40.8, +100.0] | unfinished: iteration 1 of 2 |" in text
    assert "- tiny: RL beats the best prompt in 0 of 1 seeds (1 unfinished left out: seed 1)." in text
    assert "results: note: tiny seed 1 is unfinished: iteration 1 of 2: marked in the table" in capsys.readouterr().err


def test_a_run_whose_last_candidate_is_not_gated_is_unfinished(tmp_path, tiny_env):
    """Every iteration logged, but killed while validating the last candidate."""
    write_run(tmp_path / "tiny" / "seed0", RL)
    with Store(tmp_path / "tiny" / "seed0" / "selfrl.db") as store:
        store.add_version(2, 1, None, "candidate", {})
    write_prompts(tmp_path / "tiny")
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert (row["finished"], row["status"], row["beats_best_prompt"]) == \
        (False, "unfinished: iteration 2 of 2, v2 not yet gated", None)
    assert "- tiny: no finished seed yet (1 unfinished left out: seed 0)." in results.markdown([row])


def test_a_run_that_stopped_itself_for_good_is_finished(tmp_path, tiny_env):
    """collapse.max_rollbacks spent after 1 of 2 iterations: resuming would not train further."""
    write_run(tmp_path / "tiny" / "seed0", RL, done=1)
    with Store(tmp_path / "tiny" / "seed0" / "selfrl.db") as store:
        store.log_event(1, "collapse_stop", "stopping: 2 collapse rollbacks exceed collapse.max_rollbacks = 1")
    write_prompts(tmp_path / "tiny")
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert (row["finished"], row["status"], row["beats_best_prompt"]) == \
        (True, "stopped at iteration 1 of 2: collapse.max_rollbacks spent", False)


def test_a_run_stopped_by_the_signal_check_is_finished_only_under_stop(tmp_path, tiny_env):
    """A first batch without signal ends the run under task.signal_check = "stop" (and only there)."""
    write_run(tmp_path / "tiny" / "seed0", None, done=0)
    with Store(tmp_path / "tiny" / "seed0" / "selfrl.db") as store:
        store.log_event(1, "preflight", "pre-flight (iteration 0, before the update): 0 of 2 groups. no signal: ...")
    write_prompts(tmp_path / "tiny")
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert row["status"] == "unfinished: iteration 0 of 2"  # the default signal_check ("warn") goes on
    assert (row["cost_ratio"], row["cost_s"]["rollout"]) == (None, 0)  # no iteration, no ratio
    assert "| tiny | 0 | 0 | 2 | 0.0 s | 0.0 s | 3.5 s | off | no iteration yet |" in results.markdown([row])
    config = tmp_path / "tiny" / "seed0" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "task": {"signal_check": "stop"}}))
    (row,) = results.table_rows(["tiny"], [0], tmp_path)
    assert row["status"] == 'stopped at iteration 0 of 2: no signal in the first batch (task.signal_check = "stop")'


def test_judge_vs_verifier_leaves_an_interrupted_run_out_of_its_tables(tmp_path, capsys):
    """An interrupted run writes report.md too; the table names it instead of reading it as a result."""
    spec = importlib.util.spec_from_file_location("judge_vs_verifier", ROOT / "scripts" / "judge_vs_verifier.py")
    jvv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jvv)
    for arm, done in (("verifier", 2), ("judge", 1)):
        folder = tmp_path / f"{arm}-s0"
        write_run(folder, RL, done=done)
        (folder / "report.md").write_text("# report\n")
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "skipped": 0}) + "\n" for s in range(done)))
    jvv.print_table(tmp_path, None)
    out = capsys.readouterr().out
    assert "| 0 | verifier | 2/5 = 0.400 [0.12, 0.77] | 4/5 = 0.800 [0.38, 0.96] | 1 | 2 of 2 |" in out
    assert "| 0 | judge |" not in out
    assert "Left out, not finished: judge-s0 (unfinished: iteration 1 of 2)" in out


def load_prompt_baseline():
    spec = importlib.util.spec_from_file_location("prompt_baseline", ROOT / "scripts" / "prompt_baseline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def held_out_ids(cfg) -> list[str]:
    from selfrl.envs import get_env

    env = get_env(cfg.task.source, **cfg.task.options)
    return [t.id for t in env.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)[1]]


@pytest.mark.parametrize("name", sorted(results.ENVIRONMENTS))
def test_every_environment_s_prompts_are_measured_on_its_run_s_held_out_tasks(name):
    """Each shipped environment's prompt baseline, with its ``prompt_args``, builds every shot
    count it measures, and holds out exactly the tasks its RL run holds out (the table refuses
    anything else, hours later)."""
    from selfrl.envs import load_run_config

    env = results.ENVIRONMENTS[name]
    args = list(env.prompt_args)
    assert args[::2] == ["--set"] * (len(args) // 2)  # the only argument the script's steps add
    overrides = {k: json.loads(v) for k, _, v in (a.partition("=") for a in args[1::2])}
    run_ids = held_out_ids(load_run_config(ROOT / env.config))
    built = load_prompt_baseline().build_shot_envs(load_run_config(ROOT / env.config, overrides), list(env.shots))
    assert [k for k, _, _ in built] == list(env.shots)
    for k, _, val in built:
        assert [t.id for t in val] == run_ids, f"k = {k}"


def test_the_repair_tier_s_three_examples_need_the_smaller_training_pool():
    """116 instances, 64 held out and 50 trained on leave 2: the 3-shot prompt is refused with the
    run's config, which is why ``swe_choice`` passes ``task.num_train=40`` to its prompts."""
    from selfrl.envs import load_run_config

    env = results.ENVIRONMENTS["swe_choice"]
    with pytest.raises(ValueError, match="--shots 3: swe refuses it"):
        load_prompt_baseline().build_shot_envs(load_run_config(ROOT / env.config), [3])
    assert "task.num_train=40" in env.prompt_args


@pytest.mark.parametrize("argv, message", [
    (["table", "--envs", "arithmetic", "arithmetic"], "--envs names arithmetic more than once; name each once"),
    (["run", "--seeds", "0", "1", "0"], "--seeds names 0 more than once; name each once"),
    # before: run --seeds -1 measured every prompt (minutes), then selfrl run refused the seed
    (["run", "--envs", "arithmetic", "--seeds", "0", "-1"], "argument --seeds: must be an integer >= 0, got '-1'"),
    (["table", "--seeds", "one"], "argument --seeds: must be an integer >= 0, got 'one'"),
    ([], "the following arguments are required: {run,table}"),  # before: "required: command"
])
def test_a_repeated_environment_or_seed_is_refused(tmp_path, capsys, argv, message):
    # before: table --envs tiny tiny --seeds 0 0 wrote 4 rows of one run, "beats the best prompt in 0 of 4 seeds"
    with pytest.raises(SystemExit) as stop:
        results.main([*argv, "--out", str(tmp_path)] if argv else argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
