"""The TRL comparisons (``benchmarks/bench_trl.py``, ``bench_trl_demo.py``, ``trl_compare.py``):
the arms' labels and settings, TRL's reward and grammar, the comparison table and its refusals,
and a tiny run of TRL where the ``bench`` extra (``trl``) is installed.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_trl  # noqa: E402
import bench_trl_demo  # noqa: E402
import trl_compare  # noqa: E402
import trl_setup  # noqa: E402



def test_checkpoint_at_equal_wall_clock():
    steps = [{"step": 1, "seconds": 10.0}, {"step": 2, "seconds": 20.0}]
    assert bench_trl_demo.checkpoint_at(steps, 20.0)["step"] == 2
    assert bench_trl_demo.checkpoint_at(steps, 19.9)["step"] == 1
    assert bench_trl_demo.checkpoint_at(steps, 9.0) is None


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the bench extra (trl) is not installed")
def test_trl_tiny(tmp_path):
    r = bench_trl_demo.main(["--tiny", "--inprocess", "--out", str(tmp_path), "--workdir", str(tmp_path / "work")])
    assert r["rollouts_per_trainer"] == 2 * 2 * 2
    assert [s["step"] for s in r["trl"]["steps"]] == [1, 2]
    assert len(r["selfrl"]["steps"]) == 2
    for s in r["trl"]["steps"]:
        assert (Path(s["adapter"]) / "adapter_model.safetensors").exists()
    per = r["rows"]["seconds per update (median)"]
    assert per["ratio"] == pytest.approx(per["selfrl"] / per["trl"])
    assert 0.0 <= r["rows"]["held-out success, equal rollouts"]["trl"] <= 1.0


def _constrained_trainer(tok, model, prompts: dict[str, str]):
    """A stand-in for a GRPOTrainer (what constrain_generation reads of one) and its counters;
    ``prompts`` maps a tool name to a prompt that offers only it (argument ``x``, 0..9)."""
    from types import SimpleNamespace

    from selfrl.chat.constrain import tool_call_constraint

    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    trainer = SimpleNamespace(model=model, processing_class=tok, eos_token_ids=[tok.eos_token_id])
    constraints = {tuple(tok(text=p)["input_ids"]): tool_call_constraint([(name, schema)]) for name, p in prompts.items()}
    return trainer, trl_setup.constrain_generation(trainer, constraints)


def test_trl_grammar_makes_trls_generate_sample_each_prompt_under_its_own_grammar(tiny_tokenizer, tiny_model):
    from selfrl.chat.toolcall import parse_tool_calls

    tok = tiny_tokenizer
    prompts = {"alpha": "call alpha:", "beta": "and now the other one, beta:"}
    trainer, stats = _constrained_trainer(tok, tiny_model, prompts)
    tok.padding_side = "left"  # as TRL pads its prompts
    batch = tok(text=[prompts["alpha"], prompts["beta"], prompts["alpha"]], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = trainer.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 do_sample=True, temperature=1.0, top_k=0, max_new_tokens=60,
                                 pad_token_id=tok.eos_token_id)
    names = []
    for row in out[:, batch["input_ids"].shape[1]:]:
        ids = row.tolist()
        assert tok.eos_token_id in ids, "the grammar ends the turn with an EOS once the call is complete"
        text, calls = parse_tool_calls(tok.decode(ids[:ids.index(tok.eos_token_id)]))
        assert text.strip() == "" and len(calls) == 1 and calls[0].error is None
        assert set(calls[0].arguments) == {"x"} and 0 <= calls[0].arguments["x"] <= 9
        names.append(calls[0].name)
    assert names == ["alpha", "beta", "alpha"]  # by row: each prompt's own tool, though unpadded lengths differ
    assert stats == {"calls": 1, "rows": 3, "failed": 0}


def test_trl_grammar_refuses_a_prompt_it_has_no_grammar_for(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    trainer, stats = _constrained_trainer(tok, tiny_model, {"alpha": "call alpha:"})
    batch = tok(text=["an unknown prompt"], return_tensors="pt")
    with pytest.raises(RuntimeError, match="no grammar for a prompt of .* tokens .*would sample it unconstrained"):
        trainer.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4)
    assert stats["calls"] == 0


def test_trl_compare_measures_each_arm_against_the_trl_arm_that_sampled_as_it_did(tmp_path):
    free = _arm("trl", "trl", [(0.0, 0, "a"), (600.0, 10, "a")], 620.0)
    constrained = _arm("trl", "trl-grammar", [(0.0, 0, "a"), (600.0, 10, "ab")], 620.0)
    ours = _arm("selfrl", "selfrl", [(0.0, 0, "a"), (300.0, 5, "ab"), (600.0, 10, "abc")], 620.0)
    ours_free = _arm("selfrl", "selfrl-free", [(0.0, 0, "a"), (600.0, 2, "a")], 620.0)
    table = trl_compare.compare([free, constrained, ours, ours_free], [0.5])
    against = {r["label"]: (r["trl_label"], r["trl_final"]) for r in table["rows"]}
    assert against == {"trl": ("trl", 0.25), "trl-grammar": ("trl-grammar", 0.5), "selfrl": ("trl-grammar", 0.5),
                       "selfrl-free": ("trl", 0.25)}
    mine = table["rows"][2]
    assert (mine["reach_trl_final_s"], mine["speedup"]) == (300.0, 2.0)
    with pytest.raises(SystemExit, match=r"trl-grammar \(seed 0\) passed more than once"):
        trl_compare.compare([constrained, dict(constrained)], [0.5])


def test_trl_arm_labels_and_the_grammar_flag_default_by_arm():
    assert [bench_trl.arm_label(a, g) for a in ("trl", "selfrl") for g in (False, True)] == \
        ["trl", "trl-grammar", "selfrl-free", "selfrl"]
    # a TRL result written before --grammar recorded grammar: true though TRL sampled freely
    assert trl_compare.sampled_with_grammar({"arm": "trl", "label": "trl", "grammar": True}) is False


def _arm(arm: str, label: str, curve: list[tuple[float, int, str]], training_s: float) -> dict:
    """An arm's result as bench_trl.py writes it: ``curve`` is (seconds, step, solved task
    letters) over the held-out tasks a, b, c, d."""
    return {"arm": arm, "label": label, "seed": 0, "model": "m", "updates": curve[-1][1], "training_s": training_s,
            "curve": [{"seconds": t, "step": k, "success": len(won) / 4, "results": {x: x in won for x in "abcd"}}
                      for t, k, won in curve]}


def write_arms(folder, *arms: dict) -> list:
    """Each arm's result written to ``folder/<label>.json``, as bench_trl.py's plot reads them; the paths."""
    files = []
    for a in arms:
        files.append(folder / f"{a['label']}.json")
        files[-1].write_text(json.dumps(a))
    return files


def test_trl_plot_times_each_arm_to_trls_final_success(tmp_path):
    trl = _arm("trl", "trl", [(0.0, 0, ""), (600.0, 10, "a"), (1200.0, 20, "ab")], 1250.0)
    ours = _arm("selfrl", "selfrl", [(0.0, 0, ""), (300.0, 12, "ab"), (900.0, 40, "abc")], 930.0)
    files = write_arms(tmp_path, trl, ours)
    png = tmp_path / "curve.png"
    r = bench_trl.main(["plot", *map(str, files), "--png", str(png), "--levels", "0.3,0.6", "--out", str(tmp_path)])
    theirs, mine = r["rows"]
    assert theirs["reach"] == {"0.3": 1200.0, "0.6": None} and mine["reach"] == {"0.3": 300.0, "0.6": 900.0}
    assert (theirs["trl_final"], theirs["trl_final_s"], theirs["speedup"]) == (0.5, 1200.0, 1.0)
    assert theirs["trl_above_base"] is True
    assert (mine["final"], mine["reach_trl_final_s"], mine["speedup"]) == (0.75, 300.0, 4.0)
    # paired on a, b, c, d: TRL's final solves a b, selfrl's a b c: differences 0 0 1 0, mean 0.25,
    # sample standard deviation 0.5, half width 1.96 x 0.5 / 2
    assert mine["paired_vs_trl"] == pytest.approx((0.25, 0.25 - 0.49, 0.25 + 0.49))
    assert theirs["paired_vs_trl"] == (0.0, 0.0, 0.0)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "trl_compare.json").read_text())["rows"][1]["speedup"] == 4.0


def test_trl_plot_says_when_trl_never_rose_above_its_base(tmp_path, capsys):
    trl = _arm("trl", "trl", [(0.0, 0, "a"), (600.0, 5, "a")], 620.0)
    ours = _arm("selfrl", "selfrl", [(0.0, 0, "a"), (120.0, 6, "ab")], 130.0)
    files = write_arms(tmp_path, trl, ours)
    r = bench_trl.main(["plot", *map(str, files), "--png", str(tmp_path / "c.png"), "--out", str(tmp_path)])
    theirs, mine = r["rows"]
    assert (theirs["trl_above_base"], mine["trl_above_base"]) == (False, False)
    assert (mine["reach_trl_final_s"], mine["speedup"]) == (0.0, None)
    assert "seed 0: trl ended at its base's held-out success" in capsys.readouterr().out


def test_trl_plot_says_when_an_arm_has_no_trl_arm_of_its_seed(tmp_path, capsys):
    # TRL's seed 0 beside selfrl's seed 1: the row read "s to TRL's final: never", with no note
    trl = _arm("trl", "trl", [(0.0, 0, ""), (600.0, 10, "a")], 620.0)
    ours = {**_arm("selfrl", "selfrl", [(0.0, 0, ""), (120.0, 6, "ab")], 130.0), "seed": 1}
    files = write_arms(tmp_path, trl, ours)
    r = bench_trl.main(["plot", *map(str, files), "--png", str(tmp_path / "c.png"), "--out", str(tmp_path)])
    mine = r["rows"][1]
    assert "trl_label" not in mine and "reach_trl_final_s" not in mine and "speedup" not in mine
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "selfrl (seed" in line)
    assert "never" not in row
    assert ("seed 1: selfrl has no TRL arm of its seed among the files, so it is compared with none; pass the TRL "
            "arm's result of seed 1 too (bench_trl.py --arm trl [--grammar] --seed 1)") in " ".join(out.split())


def test_trl_plot_counts_skipped_iterations_apart_from_updates(tmp_path, capsys):
    # the column was "updates" and counted iterations: 152 for an arm that updated 3 times
    trl = _arm("trl", "trl", [(0.0, 0, "a"), (600.0, 2, "ab")], 620.0)
    trl["train"] = {"steps": [{"step": 1, "seconds": 300.0}, {"step": 2, "seconds": 600.0}]}
    ours = _arm("selfrl", "selfrl", [(0.0, 0, "a"), (120.0, 4, "ab")], 130.0)
    ours["train"] = {"steps": [{"step": k, "seconds": 30.0 * k, "skipped": k != 3} for k in (1, 2, 3, 4)]}
    files = write_arms(tmp_path, trl, ours)
    r = bench_trl.main(["plot", *map(str, files), "--png", str(tmp_path / "c.png"), "--out", str(tmp_path)])
    theirs, mine = r["rows"]
    assert (theirs["iterations"], theirs["updates"]) == (2, 2) and (mine["iterations"], mine["updates"]) == (4, 1)
    header = next(line for line in capsys.readouterr().out.splitlines() if " arm " in line)
    assert [c.strip() for c in header.split("┃")[1:4]] == ["arm", "iterations", "updates"]


def test_trl_plot_refuses_arms_scored_on_different_tasks(tmp_path):
    a = _arm("trl", "trl", [(0.0, 0, "")], 0.0)
    b = _arm("selfrl", "selfrl", [(0.0, 0, "")], 0.0)
    b["curve"][0]["results"] = {"z": True}
    for x in (a, b):
        (tmp_path / f"{x['label']}.json").write_text(json.dumps(x))
    with pytest.raises(SystemExit, match="different held-out tasks"):
        bench_trl.main(["plot", str(tmp_path / "trl.json"), str(tmp_path / "selfrl.json"), "--png",
                        str(tmp_path / "c.png"), "--out", str(tmp_path)])


def test_trl_help_names_the_plot_subcommand(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_trl.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert "bench_trl.py plot RESULT.json [RESULT.json ...] [--png PNG] [--levels LEVELS] [--out OUT]" in out
    assert "Subcommand: bench_trl.py plot RESULT.json ... draws the figure" in out


@pytest.mark.parametrize("content, message", [
    (None, "no such result file: {path}; run an arm first (bench_trl.py --arm trl|selfrl)"),
    ("{", "{path}: not JSON (Expecting property name"),
    ("[1, 2]", "{path}: holds a list, not an arm's result"),
    ('{"arm": "trl"}', "{path}: not an arm's result of bench_trl.py (no 'label', 'seed', 'model', 'updates', "
                       "'training_s', 'curve')"),
    ("ARM_EMPTY_CURVE", "{path}: its 'curve' is not a non-empty list of points"),
    ("ARM_BAD_POINT", "{path}: point 0 of its 'curve' has no 'results'"),
])
def test_trl_plot_refuses_a_missing_or_malformed_file_without_a_traceback(tmp_path, capsys, content, message):
    path = tmp_path / "arm.json"
    arm = _arm("trl", "trl", [(0.0, 0, "")], 0.0)
    if content == "ARM_EMPTY_CURVE":
        content = json.dumps({**arm, "curve": []})
    elif content == "ARM_BAD_POINT":
        content = json.dumps({**arm, "curve": [{"seconds": 0, "step": 0, "success": 0.0}]})
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        bench_trl.main(["plot", str(path), "--png", str(tmp_path / "c.png"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"bench_trl.py plot: error: {message.format(path=path)}" in err
    assert "Traceback" not in err and not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("levels", ["", "a,b", "0.3,1.5"])
def test_trl_plot_refuses_levels_outside_0_1(tmp_path, capsys, levels):
    path = tmp_path / "arm.json"
    path.write_text(json.dumps(_arm("trl", "trl", [(0.0, 0, "")], 0.0)))
    with pytest.raises(SystemExit) as stop:
        bench_trl.main(["plot", str(path), "--levels", levels, "--png", str(tmp_path / "c.png")])
    assert stop.value.code == 2
    assert f"--levels takes numbers in [0, 1] separated by commas, got {levels!r}" in capsys.readouterr().err


def test_trl_eval_points_score_each_reached_step_once():
    steps = [{"step": k, "seconds": s} for k, s in ((1, 50.0), (2, 130.0), (3, 170.0), (4, 250.0))]
    # at 120 s step 1 is still the last, at 240 s step 3: neither is scored twice
    assert [(t, s and s["step"]) for t, s in bench_trl.eval_points(steps, 60.0)] == [
        (0.0, None), (60.0, 1), (180.0, 3), (250.0, 4)]
    with pytest.raises(ValueError, match="--eval-every"):
        bench_trl.eval_points(steps, 0.0)


def test_trl_reward_scores_a_completion_as_selfrl_scores_its_rollout():
    """TRL's reward is selfrl's on the completion cut after its first call (selfrl stops there):
    the right call earns 1.0 whatever follows, a wrong argument value partial credit."""
    from selfrl.envs import get_env, load_run_config
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.core.tasks import split_tasks

    cfg = load_run_config(bench_trl.CONFIG)
    source = get_env(cfg.task.source, **cfg.task.options)
    train, _ = split_tasks(source, cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    task = train[0]
    (name, args), = json.loads(task.answer)[0].items()
    right = {"name": name, "arguments": {k: v[0] for k, v in args.items() if v[0] != ""}}
    wrong = {"name": name, "arguments": {k: "no such value" for k in right["arguments"]}}
    texts = [f"<tool_call>{json.dumps(right)}</tool_call> and then <tool_call>{json.dumps(wrong)}</tool_call>",
             f"<tool_call>{json.dumps(wrong)}</tool_call>", "no call"]
    trajs = [bench_trl.completion_trajectory(x, task.id, "g") for x in texts]
    score_batch(trajs, {task.id: task}, source, get_preset(cfg.preset))
    assert [t.reward for t in trajs] == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("flags, message", [
    (["--eval-every", "0"], "--eval-every takes seconds > 0, got 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size takes a number of tasks >= 1, got 0"),
    (["--minutes", "-1"], "--minutes takes minutes > 0, got -1"),
    (["--gate-every", "0"], "--gate-every takes a number of updates >= 1, for --arm selfrl"),
    (["--repeats", "2"], "unrecognized arguments: --repeats 2"),  # before: accepted, and never used
    (["--minutes", "nan"], "--minutes takes minutes > 0, got nan"),  # before: TRL's arm never stopped
    (["--minutes", "inf"], "--minutes takes minutes > 0, got inf"),
    (["--eval-every", "nan"], "--eval-every takes seconds > 0, got nan"),
    (["--seed", "-1"], "--seed takes an integer >= 0, got -1"),
])
def test_trl_arm_flags_are_refused_before_any_training(tmp_path, capsys, flags, message):
    # before: --eval-every 0 trained for --minutes, then failed with a traceback
    with pytest.raises(SystemExit) as stop:
        bench_trl.main(["--arm", "selfrl", "--tiny", "--workdir", str(tmp_path / "w"), *flags])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_trl_selfrl_arm_waits_out_a_collapse_cool_down_and_ends_at_a_collapse_stop(tmp_path, monkeypatch):
    # before: the arm never asked the collapse budget, so it went on updating where `selfrl run` pauses
    import argparse

    from selfrl.run.cycle import UpdateCycle
    from selfrl.safety.collapse import CollapseStop

    args = argparse.Namespace(tiny=True, seed=0, grammar=True, gate_every=None, eval_batch_size=None)
    cfg = bench_trl.arm_config(args, tmp_path)
    answers = iter([0.0, 0.3, 0.0])  # an iteration, a cool-down of 0.3 s, an iteration, then a stop

    def budget(self):
        try:
            return next(answers)
        except StopIteration:
            raise CollapseStop("stopping: 4 collapse rollbacks exceed collapse.max_rollbacks = 3") from None

    monkeypatch.setattr(UpdateCycle, "check_budget", budget)
    out = tmp_path / "selfrl.json"
    bench_trl.worker_selfrl(cfg.to_dict(), 600.0, out)
    r = json.loads(out.read_text())
    assert [s["step"] for s in r["steps"]] == [1, 2]
    assert r["cooldown_s"] == pytest.approx(0.3)
    assert r["steps"][1]["seconds"] - r["steps"][0]["seconds"] >= 0.3  # the wait is training time
    assert r["stopped"].startswith("stopping: 4 collapse rollbacks")


def test_trl_plot_refuses_arms_not_measured_alike_or_passed_twice(tmp_path):
    # before: a copy of one arm with another model, grammar or --tiny, or one file twice, was tabulated
    a = _arm("trl", "trl-grammar", [(0.0, 0, ""), (60.0, 1, "a")], 60.0)
    b = _arm("selfrl", "selfrl", [(0.0, 0, ""), (60.0, 2, "ab")], 60.0)
    for key, value, message in (("model", "other", "the results mix models (m, other)"),
                                ("eval_constrain", "none", "the results mix evaluation grammars"),
                                ("tiny", True, "the results mix --tiny and real runs")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            trl_compare.compare([a, {**b, key: value}], [0.5])
    with pytest.raises(SystemExit, match=re.escape("selfrl (seed 0) passed more than once")):
        trl_compare.compare([a, b, dict(b)], [0.5])


def test_a_tiny_benchmark_run_without_out_never_writes_over_a_measured_result(monkeypatch, tmp_path):
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.finish({"tiny": True, "loadavg_start": 0.0}, "trl_trl_seed0", None)
    assert path == tmp_path / "tiny" / "trl_trl_seed0.json"
    assert common.finish({"tiny": False, "loadavg_start": 0.0}, "x", None) == tmp_path / "x.json"

