"""Smoke tests of the benchmarks: each runs once on a tiny random model (``--tiny``) so the
scripts don't rot, and its JSON holds the values it must (hand-computed where possible).

The TRL comparisons are tested in ``test_bench_trl.py``.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_ceiling  # noqa: E402
import bench_constrain  # noqa: E402
import bench_cost  # noqa: E402
import bench_hotswap  # noqa: E402
import bench_learner_memory  # noqa: E402
import bench_scaling  # noqa: E402
from common import Stats  # noqa: E402

TINY = ["--tiny", "--repeats", "1"]


def test_stats_median_min_max():
    s = Stats.of([0.5, 4.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (1.5, 0.5, 4.0, 4)
    assert s.fmt(".1f") == "1.5 [0.5, 4.0]"
    with pytest.raises(ValueError):
        Stats.of([])


def test_hotswap_tiny(tmp_path):
    r = bench_hotswap.main(TINY + ["--out", str(tmp_path)])
    # tiny Llama (hidden 32, intermediate 64, 4 heads of 8, 2 kv heads, 2 layers), LoRA r=16 on the 7
    # linear layers of each block: q 1024 + k 768 + v 768 + o 1024 + gate/up/down 1536 each = 8192
    # parameters per layer, 2 layers, fp32.
    assert r["num_lora_tensors"] == 2 * 7 * 2
    assert r["lora_tensor_bytes"] == 2 * 8192 * 4
    assert r["logits_match_after_swap"] is True
    assert r["full_reload_s"].median > 0 and r["swap_memory_s"].median > 0
    saved = json.loads((tmp_path / "hotswap.json").read_text())
    assert saved["full_reload_s"]["n"] == 1 and saved["machine"]["nproc"] >= 1


def test_matmul_params_counts_tied_embedding_once(tiny_model_factory):
    model = tiny_model_factory()
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    assert bench_ceiling.matmul_params(model) == total - emb  # untied: the input embedding is a lookup
    model.lm_head.weight = model.get_input_embeddings().weight  # tie
    tied_total = sum(p.numel() for p in model.parameters())  # shared tensor counted once
    assert bench_ceiling.matmul_params(model) == tied_total


def test_ceiling_tiny(tmp_path):
    r = bench_ceiling.main(TINY + ["--out", str(tmp_path)])
    assert r["batch_size"] == 4 and r["max_new_tokens"] == 8
    assert 4 <= r["generated_tokens"] <= 4 * 8
    assert r["generation_bound_tokens_per_s"] == pytest.approx(r["matmul_flops_per_s"].median / (2 * r["matmul_params"]))
    assert r["generation_fraction"] == pytest.approx(r["generation_tokens_per_s"] / r["generation_bound_tokens_per_s"])
    assert r["last_update_metrics"]["num_sequences"] == 4  # every rollout carried an advantage
    assert (tmp_path / "ceiling.json").exists()


def test_scaling_tiny(tmp_path):
    png = tmp_path / "scaling.png"
    r = bench_scaling.main(TINY + ["--out", str(tmp_path), "--plot", str(png)])
    # base point plus one move per variable (two values each in the tiny grid)
    assert [(p["num_generations"], p["completion_length"], p["lora_r"]) for p in r["points"]] == [
        (2, 4, 2), (4, 4, 2), (2, 8, 2), (2, 4, 4)]
    assert [p["sequences"] for p in r["points"]] == [4, 8, 4, 4]
    assert [p["completion_tokens"] for p in r["points"]] == [16, 32, 32, 16]
    assert all(p["skipped"] == 0.0 for p in r["points"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_synthetic_batch_shapes(tiny_tokenizer):
    trajs = bench_scaling.synthetic_batch(tiny_tokenizer, [[1, 2, 3], [4, 5]], num_generations=2, completion_length=3)
    assert len(trajs) == 4
    assert [t.completion_mask for t in trajs[:2]] == [[0, 0, 0, 1, 1, 1]] * 2
    assert [t.advantage for t in trajs] == [-1.0, 1.0, -1.0, 1.0]
    assert all(t.token_ids[-1] == tiny_tokenizer.eos_token_id for t in trajs)


def test_cost_tiny(tmp_path):
    r = bench_cost.main(TINY + ["--out", str(tmp_path)])
    rows = [json.loads(line) for line in open(Path(r["run_dir"]) / "metrics.jsonl")]
    its = [x for x in rows if "time/rollout_s" in x]
    inference = sum(x["time/rollout_s"] for x in its)
    training = sum(x.get("time/update_s", 0.0) for x in its)
    assert r["iterations"] == 2 and r["rollouts_per_iteration"] == 4
    assert r["inference_s"] == pytest.approx(inference)
    assert r["cost_ratio"] == pytest.approx((inference + training) / inference)
    assert r["generated_tokens"] == pytest.approx(sum(x["train/completion_tokens"] * 4 for x in its))
    assert r["validations"] >= 1  # the base model at least
    assert (r["finished"], r["status"]) == (True, "finished")


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_every_benchmark_refuses_fewer_than_one_repeat(value, capsys):
    from common import base_parser

    with pytest.raises(SystemExit) as stop:
        base_parser("A benchmark.").parse_args(["--repeats", value])
    assert stop.value.code == 2
    assert f"argument --repeats: must be an integer >= 1, got {value!r}" in capsys.readouterr().err
    assert base_parser("A benchmark.").parse_args(["--repeats", "1"]).repeats == 1


def test_every_benchmark_refuses_a_file_for_its_out_folder_before_any_work(tmp_path, capsys):
    from common import base_parser

    afile = tmp_path / "result.json"
    afile.write_text("{}")
    for given in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as stop:
            base_parser("A benchmark.").parse_args(["--out", str(given)])
        assert stop.value.code == 2
        under = "" if given == afile else f" ({given} lies under it)"
        assert f"argument --out: {afile} is a file, not a folder{under}: give a folder path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the benchmark of the report: refused before its first measurement
        bench_learner_memory.main(["--tiny", "--out", str(afile)])
    assert stop.value.code == 2
    assert afile.read_text() == "{}"
    assert base_parser("A benchmark.").parse_args(["--out", str(tmp_path / "new")]).out == tmp_path / "new"


def test_cost_refuses_missing_run(tmp_path):
    with pytest.raises(FileNotFoundError):
        bench_cost.cost_figures(tmp_path)


def test_cost_marks_a_run_that_has_not_finished(tmp_path, capsys):
    """Killed after 1 of its 3 iterations: the figures are over that one, and say so."""
    from selfrl.record.store import Store

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"iterations": 3, "num_prompts": 2, "num_generations": 2,
                                                     "gate": {"val_size": 4}}))
    with Store(run_dir / "selfrl.db") as store:
        run = store.start_run({})
        store.log_metrics(run, 0, {"reward/mean": 0.5, "time/rollout_s": 2.0, "time/update_s": 1.0,
                                   "train/completion_tokens": 5.0, "num_tokens": 12.0})
    r = bench_cost.main(["--run-dir", str(run_dir), "--out", str(tmp_path)])
    assert (r["finished"], r["status"], r["iterations"]) == (False, "unfinished: iteration 1 of 3", 1)
    assert r["cost_ratio"] == pytest.approx(1.5) and r["generated_tokens"] == pytest.approx(20.0)
    assert json.loads((tmp_path / "cost.json").read_text())["status"] == "unfinished: iteration 1 of 3"
    out, err = capsys.readouterr()
    assert "(0 updates skipped); unfinished: iteration 1 of 3" in out
    assert f"bench_cost: note: the run at {run_dir} is unfinished: iteration 1 of 3: the figures are over the " \
           "1 iterations it has" in err


def test_overlap_tiny(tmp_path):
    import bench_overlap

    r = bench_overlap.main(TINY + ["--out", str(tmp_path)])
    assert set(r["engines"]) == {"reference", "slots"}
    for e in r["engines"].values():
        sec = e["seconds"]
        assert sec["serial"].median == pytest.approx(sec["rollouts"].median + sec["update"].median)
        assert e["serial_over_overlapped"].median == pytest.approx(sec["serial"].median / sec["overlapped"].median)
        # the overlapped pair ends with the later of its two halves
        assert sec["overlapped"].median >= max(sec["rollouts_overlapped"].median, sec["update_overlapped"].median)
        assert e["sampled_tokens"][0] >= 4
    assert (tmp_path / "overlap.json").exists()


def test_driver_tiny(tmp_path):
    import bench_driver

    r = bench_driver.main(TINY + ["--out", str(tmp_path)])
    thread, caller = r["runs"]["thread"][0], r["runs"]["caller"][0]
    assert (thread["driver"], caller["driver"]) == ("thread", "caller")  # each child ran the driver it was given
    assert thread["tasks"] == caller["tasks"] == 2 and thread["success"] == caller["success"]  # same greedy answers
    assert r["thread_over_caller"].median == pytest.approx(thread["validate_s"] / caller["validate_s"])
    assert (tmp_path / "driver.json").exists()


def test_engines_tiny(tmp_path):
    import bench_engines

    r = bench_engines.main(TINY + ["--out", str(tmp_path), "--clients", "1,3", "--requests", "1"])
    assert set(r["rollouts"]) == {"reference", "slots"}
    for name in ("reference", "slots"):
        roll = r["rollouts"][name]
        assert roll["tokens"][0] >= 4 and roll["tokens_per_s"].median > 0  # 4 rollouts, >= 1 token each
        assert roll["fraction_of_bound"] == roll["tokens_per_s"].median / r["generation_bound_tokens_per_s"]
        levels = r["serve"][name]
        assert [lv["clients"] for lv in levels] == [1, 3] and [lv["requests"] for lv in levels] == [1, 3]
        assert all(0 < lv["ttft_s"].max <= lv["latency_s"].max for lv in levels)
        assert all(1 <= lv["completion_tokens"] <= 8 * lv["requests"] for lv in levels)
    assert (tmp_path / "engines.json").exists()


def test_constrain_tiny(tmp_path):
    r = bench_constrain.main(TINY + ["--out", str(tmp_path)])
    from conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    body = tok.encode("<tool_call>" + bench_constrain.ANSWER + "</tool_call>", add_special_tokens=False)
    assert r["tokenizer"] == "tiny (tests)" and r["vocab"] == len(tok)
    assert r["llguidance"]["tokens"] == len(body) + 1 and r["llguidance"]["per_token_s"].median > 0  # + EOS
    assert [row[0] for row in r["engine"]] == ["engine, tiny model, free", "engine, tiny model, tool_call grammar"]
    assert json.loads((tmp_path / "constrain.json").read_text())["llguidance"]["tokens"] == len(body) + 1


def test_serve_tiny(tmp_path):
    import bench_serve

    r = bench_serve.main(["--tiny", "--out", str(tmp_path), "--clients", "1,3", "--requests", "1"])
    assert r["engines"] == ["reference", "slots"]
    for name in ("reference", "slots"):
        levels = r["serve"][name]
        assert [lv["clients"] for lv in levels] == [1, 3] and [lv["requests"] for lv in levels] == [1, 3]
        assert all(lv["errors"] == [] and 0 < lv["ttft_p50_s"] <= lv["ttft_p90_s"] <= lv["latency_s"].max
                   for lv in levels)
        assert all(1 <= lv["completion_tokens"] <= 8 * lv["requests"] for lv in levels)
        assert all(lv["tokens_per_s"] == lv["completion_tokens"] / lv["wall_s"] for lv in levels)
    for k, ratio in enumerate(r["ratios"]["levels"]):
        assert ratio["ttft_p50"] == r["serve"]["slots"][k]["ttft_p50_s"] / r["serve"]["reference"][k]["ttft_p50_s"]
    assert (tmp_path / "serve.json").exists()


def test_serve_tiny_clients_in_a_child_process(tmp_path):
    import bench_serve

    r = bench_serve.main(["--tiny", "--out", str(tmp_path), "--engines", "slots", "--clients", "2", "--requests", "1",
                                 "--client-process", "both"])
    assert r["clients_in"] == ["thread", "process"] and list(r["serve"]) == ["slots/thread", "slots/process"]
    for key, way in (("slots/thread", "thread"), ("slots/process", "process")):
        (lv,) = r["serve"][key]
        assert lv["clients_in"] == way and lv["requests"] == 2 and lv["errors"] == []
        assert 0 < lv["ttft_p50_s"] <= lv["latency_s"].max  # the child's Stats came back as Stats
    ratio = r["ratios"]["levels"][0]
    assert ratio["ttft_p50"] == r["serve"]["slots/process"][0]["ttft_p50_s"] / r["serve"]["slots/thread"][0]["ttft_p50_s"]


def test_merged_tiny(tmp_path):
    import bench_merged

    r = bench_merged.main(TINY + ["--rows", "1,3", "--out", str(tmp_path)])
    # tiny Llama, LoRA on its 2 x 7 linear layers: q 32x32, k 16x32, v 16x32, o 32x32, gate and up
    # 64x32, down 32x64 = 9,216 weights a layer, merged copies in fp32; and oneDNN's packed copies of
    # those 14 merged weights (selfrl.model.matmul.pack)
    from selfrl.model.matmul import packing_available

    packed = 2 * 9216 * 4 if packing_available() else 0
    assert (r["merged_layers"], r["merged_extra_bytes"]) == (14, 2 * 9216 * 4 + packed)
    assert sorted(r["products"]) == [1, 2, 3, 4] and all(v > 0 for p in r["products"].values() for v in p.values())
    for rows in (1, 3):
        s = r["steps_ms"][rows]
        assert s["unmerged_over_merged"] == pytest.approx(s["unmerged"].median / s["merged"].median)
    assert r["rollouts"]["merged"]["tokens"][0] > 0 and r["rollouts"]["unmerged"]["tokens"][0] > 0
    assert max(r["max_abs_logprob_gap"].values()) < 1e-4  # both engines sample the policy's own logprobs
    assert (tmp_path / "merged.json").exists()


def test_update_tiny(tmp_path):
    import bench_update

    r = bench_update.main(TINY + ["--repeats", "1", "--out", str(tmp_path)])
    tokens = r["encoded_tokens"]
    # the tree never encodes more than the rows' common prefix once, which never encodes more than the rows
    assert 0 < tokens["tree"] <= tokens["prefix"] <= tokens["rows"]
    assert tokens["tree"] < tokens["rows"]  # the batch's samples share at least their prompt
    assert r["max_abs_loss_gap"] < 1e-5  # the same update whichever way it is encoded
    assert r["over_tree"]["tree"] == 1.0 and r["seconds"]["rows"].n == 1
    assert (tmp_path / "update.json").exists()


def test_shared_attention_tiny(tmp_path):
    import bench_shared_attention

    r = bench_shared_attention.main(TINY + ["--repeats", "1", "--rows", "8,2", "--out", str(tmp_path)])
    assert r["shared_prefix_layers"] == 2  # the tiny Llama's two attention layers take the shared prefix
    assert r["same_rollout_tokens"] and r["rollouts"]["shared prefix once"]["tokens"][0] > 0
    for rows in (8, 2):  # the same greedy ids either way
        lv = r["long_system_prompt"][rows]
        assert lv["same_ids"] and lv["tokens"] > 0 and lv["prompt_tokens"] > 64
        assert lv["speed_up"] == pytest.approx(lv["own copies"].median / lv["shared prefix once"].median)
    from selfrl.engines.sharedattention import fused_kernel_available

    # the kernel table: the demo's first two shapes, both ways, the same attention to fp32 rounding
    kernel = r["kernel"]
    assert [(k["rows"], k["queries"]) for k in kernel] == ([(64, 1), (55, 1)] if fused_kernel_available() else [])
    assert all(k["products_us"] > 0 and k["fused_us"] > 0 and k["max_abs_diff"] < 1e-5 for k in kernel)
    assert (tmp_path / "shared_attention.json").exists()


def test_matmul_tiny(tmp_path):
    import bench_matmul

    from selfrl.model.matmul import available

    r = bench_matmul.main(TINY + ["--rows", "1,16", "--out", str(tmp_path)])
    frozen = r["routed_layers"]["auto"]
    assert r["routed_layers"]["torch"] == 0 and frozen == (15 if available() else 0)  # 2 layers x 7, the head
    assert set(r["matmul_flops_per_s"]) == ({"torch", "onednn"} if available() else {"torch"})
    assert set(r["pass_products_s"]) == {1, 16}
    roll = r["rollouts"]
    assert roll["torch"]["tokens"] == roll["auto"]["tokens"] and roll["auto"]["tokens"][0] > 0  # the same samples
    assert r["update"]["loss_gap"] < 1e-5  # the same update through either library
    assert r["update"]["speed_up"] == pytest.approx(r["update"]["torch"]["seconds"].median
                                                    / r["update"]["auto"]["seconds"].median)
    assert (tmp_path / "matmul.json").exists()


def test_packed_tiny(tmp_path):
    import bench_packed

    r = bench_packed.main(TINY + ["--out", str(tmp_path)])
    two, one = r["rollouts"]["two passes"], r["rollouts"]["one packed pass"]
    # the tiny batch's one-turn rows all start together, so nothing packs here (tests/test_packed_passes.py
    # covers packed steps); the table's fields and the same ids either way
    assert two["packed_passes"] == 0 and one["packed_passes"] == one["admitting_steps"] == 0
    assert one["same_ids_as_first"] and two["tokens"] == one["tokens"] and two["tokens"][0] > 0
    assert r["bound_tokens_per_s"] > 0 and two["speed_up"] == 1.0 and (tmp_path / "packed.json").exists()


def test_drafts_tiny(tmp_path):
    import bench_drafts

    r = bench_drafts.main(TINY + ["--rows", "1,4", "--ids", "1,3", "--out", str(tmp_path)])
    assert r["settings"] == ["0/16", "4/16"]
    assert set(r["pass_seconds"]) == {1, 4} and all(set(v) == {1, 3} for v in r["pass_seconds"].values())
    for phase in ("rollouts", "validation"):
        off, on = r[phase]["0/16"], r[phase]["4/16"]
        assert off["drafted"] == 0 and on["same_ids_as_first"]  # drafts change no sampled id
        assert off["tokens"] == on["tokens"] and on["tokens"][0] > 0


def test_choice_tiny(tmp_path):
    import bench_choice

    r = bench_choice.main(TINY + ["--rows", "4,16", "--draws", "256", "--out", str(tmp_path)])
    assert r["vocab"] == 4096 and r["draws"] == 256 and set(r["microseconds"]) == {4, 16}
    for t in r["microseconds"].values():
        assert t["speed_up"] == pytest.approx(t["one cumulative sum"] / t["two levels"])
    # both search the same distribution: at most a few points within rounding of a boundary differ from float64
    assert all(0 <= n <= 4 for n in r["differ_from_float64"].values())
    assert (tmp_path / "choice.json").exists()


def test_checkouts_tiny(tmp_path):
    import bench_checkouts

    from common import ROOT

    # this checkout against itself: the same ids in every batch, each process's selfrl its own checkout's
    r = bench_checkouts.main(["--tiny", "--before", str(ROOT), "--rounds", "1", "--seeds", "1", "--out", str(tmp_path)])
    before, after = r["checkouts"]["before"], r["checkouts"]["after"]
    assert r["same_ids"] and before["tokens"] == after["tokens"] > 0
    assert r["speed_up_by_seed"][0] == pytest.approx(after["median_tokens_per_s"] / before["median_tokens_per_s"])
    assert after["fraction_of_bound"] == pytest.approx(after["median_tokens_per_s"] / r["bound_tokens_per_s"])
    with pytest.raises(SystemExit, match="another checkout"):
        bench_checkouts.main(["--tiny", "--before", str(tmp_path)])


def test_vllm_skips_without_a_vllm(capsys):
    import bench_vllm

    assert bench_vllm.main(["--tiny"]) is None and bench_vllm.main([]) is None
    out = capsys.readouterr().out
    assert "--tiny has no vLLM model" in out and "no --vllm-python" in out


def test_serve_memory_tiny(tmp_path):
    import bench_serve_memory

    assert bench_serve_memory.slope([1.0, 3.0, 5.0]) == 2.0
    r = bench_serve_memory.main(["--tiny", "--rounds", "6", "--tokens", "4", "--val-size", "2", "--out", str(tmp_path)])
    arms = r["arms"]
    assert list(arms) == ["unbounded", "bounded", "gate-kv-kept", "bounded+trim"]
    for data in arms.values():
        assert len(data["rss_mb"]) == 6 and all(x > 100 for x in data["rss_mb"])
        assert data["outcomes"] == ["promoted"] * 6  # tolerance 1: a state a version
    # the server's bound (ServedVersion.STATES_KEPT) holds in the bounded arms only
    assert arms["unbounded"]["states_kept"] == 6 and arms["bounded"]["states_kept"] == 4
    # the learner's gate engine holds key/value memory between updates only where it was told to keep it
    assert all(learner > 0 for _, learner in arms["gate-kv-kept"]["kv_mb"])
    assert all(learner == 0 for _, learner in arms["bounded+trim"]["kv_mb"])
    r = bench_serve_memory.main(["--tiny", "--rounds", "3", "--tokens", "4", "--val-size", "2", "--out", str(tmp_path),
                                 "--arms", "gate-kv-kept,bounded+trim"])
    assert list(r["arms"]) == ["gate-kv-kept", "bounded+trim"]
    assert (tmp_path / "serve_memory.json").exists()
