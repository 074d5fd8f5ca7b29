"""``scripts/prompt_baseline.py``: the k-shot baseline runs on the run's engine, in bounded batches.

It evaluated every held-out task in one batch on the reference engine, whatever the config
said, and a 128-task BFCL baseline was killed at 11.9 GB RSS. A stand-in engine around the
real one records the size of each ``generate`` call.
"""

import importlib.util
from pathlib import Path

import pytest

import selfrl.engines

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("prompt_baseline", ROOT / "scripts" / "prompt_baseline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Recording:
    """The real engine, with the number of prompts of each ``generate`` call recorded."""

    def __init__(self, engine, calls):
        self.engine, self.calls = engine, calls

    def generate(self, prompts, *args, **kwargs):
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def write_config(tmp_path, model_dir, val_size=5, batch_size=64, engine="auto"):
    path = tmp_path / "c.toml"
    path.write_text(f"""
engine = "{engine}"
[model]
name = "{model_dir}"
device = "cpu"
[lora]
r = 4
[task]
source = "arithmetic"
num_train = 20
[rollout]
max_new_tokens = 6
max_turns = 1
[gate]
val_size = {val_size}
batch_size = {batch_size}
""")
    return path


@pytest.fixture
def recorded(monkeypatch):
    """``(calls, names)``: batch sizes of every generate call and the engine names asked for."""
    calls, names = [], []
    real = selfrl.engines.make_engine

    def make(name, model, tok, *a, **k):
        names.append(name)
        return Recording(real("reference", model, tok, *a, **k), calls)

    monkeypatch.setattr(selfrl.engines, "make_engine", make)
    return calls, names


def test_batches_are_bounded_by_the_flag(tmp_path, model_dir, recorded, capsys):
    """7 held-out tasks with --batch-size 3: generate sees 3, 3, 1 prompts (it saw 7 at once)."""
    calls, names = recorded
    cfg = write_config(tmp_path, model_dir, val_size=7)
    assert load_script().main(["--config", str(cfg), "--shots", "0", "--batch-size", "3"]) == 0
    assert calls == [3, 3, 1]
    out = capsys.readouterr()
    assert "base model, 0-shot prompt: " in out.out and "/7 = " in out.out
    assert "0-shot: 3/7 tasks" in out.err and "0-shot: 7/7 tasks" in out.err  # progress after each batch


def test_batches_follow_the_config_and_its_engine(tmp_path, model_dir, recorded):
    """Without flags: gate.batch_size and the config's engine; --engine overrides the engine."""
    calls, names = recorded
    cfg = write_config(tmp_path, model_dir, val_size=5, batch_size=2, engine="slots")
    script = load_script()
    assert script.main(["--config", str(cfg), "--shots", "0"]) == 0
    assert calls == [2, 2, 1] and names == ["slots"]
    assert script.main(["--config", str(cfg), "--shots", "0", "--engine", "reference"]) == 0
    assert names == ["slots", "reference"]


def test_bad_engine_or_batch_size_is_one_line(tmp_path, model_dir, recorded, capsys):
    cfg = write_config(tmp_path, model_dir)
    script = load_script()
    assert script.main(["--config", str(cfg), "--shots", "0", "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err
    assert script.main(["--config", str(cfg), "--shots", "0", "--engine", "vllm-ish"]) == 2
    err = capsys.readouterr().err
    assert "vllm-ish" in err and "reference" in err


def test_shots_without_demonstration_are_refused(tmp_path, model_dir, recorded, capsys):
    """k worked examples with rollout.demonstration = false would show none: said, nothing evaluated."""
    calls, _ = recorded
    cfg = write_config(tmp_path, model_dir)
    assert load_script().main(["--config", str(cfg), "--shots", "0", "2", "--set", "rollout.demonstration=false"]) == 2
    assert "rollout.demonstration" in capsys.readouterr().err and calls == []


def test_an_unfinished_run_is_refused_before_the_model_loads(tmp_path, model_dir, monkeypatch, capsys):
    """A run killed after 1 of its 2 iterations: its final version is not its result. The same run
    finished gets past the check (to the model load, stopped here)."""
    import json

    from selfrl.record.store import Store

    class Loaded(Exception):
        pass

    def build_policy(cfg):
        raise Loaded

    monkeypatch.setattr("selfrl.model.load.build_policy", build_policy)
    cfg = write_config(tmp_path, model_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"iterations": 2}))
    with Store(run_dir / "selfrl.db") as store:
        run = store.start_run({})
        store.log_metrics(run, 0, {"reward/mean": 0.5})
        store.add_version(0, None, None, "base", {"val/success": 0.5})
        store.add_evaluation(0, [("t1", True, None), ("t2", False, None)])
        store.add_version(1, 0, None, "promoted", {"val/success": 1.0})
        store.add_evaluation(1, [("t1", True, None), ("t2", True, None)])
    argv = ["--config", str(cfg), "--shots", "0", "--run-dir", str(run_dir)]
    assert load_script().main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"prompt_baseline: error: run {run_dir} is unfinished: iteration 1 of 2: its final version is not the "
        f"run's result yet; let it finish (selfrl run --resume {run_dir}), or leave out --run-dir and pair the "
        "prompts with the run later (--per-task)")
    with Store(run_dir / "selfrl.db") as store:
        store.log_metrics(run, 1, {"reward/mean": 0.5})
    with pytest.raises(Loaded):
        load_script().main(argv)


class Loaded(Exception):
    """The model would load: every refusal below comes before it."""


@pytest.fixture
def no_model(monkeypatch):
    def build_policy(cfg):
        raise Loaded

    monkeypatch.setattr("selfrl.model.load.build_policy", build_policy)


@pytest.mark.parametrize("given", ["-1", "two"])
def test_every_shot_count_is_checked_before_any_evaluation(given, tmp_path, model_dir, no_model, capsys):
    cfg = write_config(tmp_path, model_dir)
    with pytest.raises(SystemExit) as stop:
        load_script().main(["--config", str(cfg), "--shots", "0", "3", given])
    assert stop.value.code == 2
    assert f"argument --shots: must be an integer >= 0, got {given!r}" in capsys.readouterr().err


def test_more_shots_than_the_environment_allows_are_refused_at_once(tmp_path, model_dir, no_model, capsys):
    cfg = write_config(tmp_path, model_dir)
    text = cfg.read_text().replace('source = "arithmetic"', 'source = "code"\noptions = { tier = "easy" }')
    cfg.write_text(text)
    assert load_script().main(["--config", str(cfg), "--shots", "0", "100000"]) == 2
    assert capsys.readouterr().err == ("prompt_baseline: error: --shots 100000: code refuses it: code: shots must be "
                                       "an integer in 0-3, got 100000\n")


def test_per_task_in_a_missing_folder_is_refused_before_any_work(tmp_path, model_dir, no_model, capsys):
    cfg = write_config(tmp_path, model_dir)
    where = tmp_path / "nowhere" / "per_task.json"
    assert load_script().main(["--config", str(cfg), "--shots", "0", "--per-task", str(where)]) == 2
    assert capsys.readouterr().err == (f"prompt_baseline: error: --per-task {where}: the folder {where.parent} does "
                                       "not exist; create it or give a path in an existing folder\n")


def test_flags_have_help_and_the_transformers_warning_is_silenced(tmp_path, model_dir, no_model, capsys):
    import warnings

    with pytest.raises(SystemExit):
        load_script().main(["--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "the run's TOML config (selfrl run --config)" in help_
    assert "worked examples shown before each task" in help_
    assert "a finished selfrl run of the same config" in help_
    cfg = write_config(tmp_path, model_dir)
    with warnings.catch_warnings():  # the filters are restored after
        warnings.resetwarnings()
        with pytest.raises(Loaded):
            load_script().main(["--config", str(cfg), "--shots", "0"])
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
            warnings.warn("another deprecation", FutureWarning)
        assert [str(w.message) for w in seen] == ["another deprecation"]


def test_a_prompt_on_which_every_task_failed_is_refused_not_reported_as_zero(tmp_path, model_dir, capsys):
    """More examples than the environment can show make every rollout fail (so does a prompt beyond
    the model's context): that was printed as a measured 0/N = 0.0 % (exit 0)."""
    cfg = write_config(tmp_path, model_dir, val_size=3)
    per_task = tmp_path / "per_task.json"
    assert load_script().main(["--config", str(cfg), "--shots", "0", "400", "--per-task", str(per_task)]) == 2
    out = capsys.readouterr()
    assert "base model, 0-shot prompt: " in out.out and "400-shot" not in out.out
    last = out.err.splitlines()[-1]
    assert last.startswith("prompt_baseline: error: --shots 400: every held-out task failed (3 of 3), e.g. ")
    assert "400 shots" in last and last.endswith("lower --shots (or fix what the error names)")
    assert list(__import__("json").loads(per_task.read_text())) == ["0"]  # the failed count is not kept


def test_tasks_that_failed_are_counted_as_not_solved_and_said(tmp_path, model_dir, monkeypatch, capsys):
    import selfrl.safety.gate as gate

    real = gate.validate

    def one_fails(*args, **kwargs):
        res = real(*args, **kwargs)
        tid = res.results[0][0]
        res.results[0] = (tid, False, None)
        res.errors[tid] = "RuntimeError('verifier broke')"
        return res

    monkeypatch.setattr(gate, "validate", one_fails)
    cfg = write_config(tmp_path, model_dir, val_size=4)
    assert load_script().main(["--config", str(cfg), "--shots", "0"]) == 0
    out = capsys.readouterr()
    assert "0-shot: 1 of 4 task(s) failed in their environment or verifier (counted as not solved), e.g. " in out.err
    assert "RuntimeError('verifier broke')" in out.err
    assert "; 1 failed, counted as not solved)" in out.out
