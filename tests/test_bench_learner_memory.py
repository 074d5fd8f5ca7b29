"""``benchmarks/bench_learner_memory.py`` on a tiny random model: every setting runs, makes the
same update, and cuts the micro-batches a hand count expects; its synthetic rows; its flags."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_learner_memory  # noqa: E402


def test_learner_memory_tiny_runs_every_setting_with_the_same_update(tmp_path):
    # 6 rows of 40 + 8 = 48 tokens, micro_batch_size 4: no budget -> 4 + 2 rows (2 passes); a budget of
    # 96 tokens -> 2 rows each (3); checkpointing changes neither
    r = bench_learner_memory.main(["--tiny", "--rows", "6", "--prompt-tokens", "40", "--completion-tokens", "8",
                                   "--micro-batch-size", "4", "--budgets", "0,96", "--checkpointing", "off,on",
                                   "--out", str(tmp_path)])
    names = [s["name"] for s in r["settings"]]
    assert names == ["micro_batch_tokens=0, checkpointing off", "micro_batch_tokens=96, checkpointing off",
                     "micro_batch_tokens=0, checkpointing on", "micro_batch_tokens=96, checkpointing on"]
    assert [s["micro_batches"] for s in r["settings"]] == [2, 3, 2, 3]
    assert [s["expected_micro_batches"] for s in r["settings"]] == [2, 3, 2, 3]
    first = r["settings"][0]
    # AdamW's first step moves every weight it moves by about the learning rate (serve's 1e-4)
    assert first["max_weight_move"] == pytest.approx(1e-4, rel=0.01) and first["max_weight_diff"] == 0.0
    for s in r["settings"]:
        assert s["max_weight_diff"] < 1e-4 * 1e-2, s["name"]  # the same update, to rounding
        # AdamW's first step is about lr x sign(gradient): the loss and gradient norm catch a scale error too
        assert s["stats"]["loss"] == pytest.approx(first["stats"]["loss"], rel=1e-5)
        assert s["stats"]["grad_norm"] > 0
        assert s["stats"]["grad_norm"] == pytest.approx(first["stats"]["grad_norm"], rel=1e-4)
        assert s["stats"]["num_sequences"] == 6 and s["stats"]["num_tokens"] == 6 * 8
        assert s["peak_since_update_start"] is True  # Linux: VmHWM reset before the update
        assert 0 < s["rss_start_bytes"] <= s["peak_rss_bytes"] and s["learner_peak_rss_bytes"] > 0
        assert len(s["seconds"]) == 1 and s["seconds"][0] > 0
    saved = json.loads((tmp_path / "learner_memory.json").read_text())
    assert [s["micro_batches"] for s in saved["settings"]] == [2, 3, 2, 3] and saved["rows"] == 6


def test_learner_memory_rows_are_long_scored_and_share_only_the_given_prefix():
    rows = bench_learner_memory.synthetic_rows(50, 2, [0, 1, 2], rows=4, prompt_tokens=6, completion_tokens=3,
                                               shared_prefix=2, seed=1)
    assert [len(t.token_ids) for t in rows] == [9] * 4 and all(t.prompt_len == 6 for t in rows)
    assert all(t.completion_mask == [0] * 6 + [1] * 3 for t in rows)
    assert all(t.logprobs[6:] == [pytest.approx(-math.log(50))] * 3 and t.logprobs[:6] == [0.0] * 6 for t in rows)
    assert [t.advantage for t in rows] == [1.0, -1.0, 1.0, -1.0] and [t.reward for t in rows] == [1.0, 0.0, 1.0, 0.0]
    assert all(t.token_ids[-1] == 2 and not {0, 1, 2} & set(t.token_ids[:-1]) for t in rows)
    assert len({tuple(t.token_ids[:2]) for t in rows}) == 1  # the shared prefix
    assert len({t.token_ids[2] for t in rows} | {tuple(t.token_ids[2:8]) for t in rows}) > 2  # then apart
    again = bench_learner_memory.synthetic_rows(50, 2, [0, 1, 2], 4, 6, 3, 2, seed=1)
    assert [t.token_ids for t in again] == [t.token_ids for t in rows]  # the same rows in every process


@pytest.mark.parametrize("flags, message", [
    (["--budgets", "0,-8"], "argument --budgets: must be comma-separated distinct integers >= 0, got '0,-8'"),
    (["--budgets", "0,0"], "argument --budgets: must be comma-separated distinct integers >= 0, got '0,0'"),
    (["--checkpointing", "maybe"], "argument --checkpointing: must be off, on or off,on, got 'maybe'"),
    (["--rows", "0"], "argument --rows: must be an integer >= 1, got '0'"),
    (["--prompt-tokens", "10", "--shared-prefix", "11"], "--shared-prefix (11) must be at most --prompt-tokens (10)"),
    (["--tiny", "--model", "embedded"], "--tiny and --model embedded contradict each other"),
    (["--model", "big"], "argument --model: invalid choice: 'big'"),
    (["--lora-r", "70000"], "lora.r must be >= 1 and <= 65536, got 70000"),
])
def test_learner_memory_refuses_bad_flags_before_running_anything(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_learner_memory.main(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
