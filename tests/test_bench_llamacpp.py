"""The llama.cpp comparison's own pieces (benchmarks/bench_llamacpp.py and the GGUF writer and
llama-server client beside it, llamacpp_gguf.py and llamacpp_server.py): llama.cpp itself is
not installed here, so the benchmark skips without a binary; what it computes is tested on
hand-made inputs."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_llamacpp  # noqa: E402
import llamacpp_gguf  # noqa: E402
import llamacpp_server  # noqa: E402


def test_skips_cleanly_without_a_binary(capsys):
    assert bench_llamacpp.main([]) is None
    assert "skipped: no llama-server binary given (--server PATH)" in capsys.readouterr().out
    assert bench_llamacpp.main(["--tiny", "--server", "/bin/true"]) is None
    assert "--tiny has no llama.cpp model" in capsys.readouterr().out


def test_a_missing_binary_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        bench_llamacpp.main(["--server", str(tmp_path / "llama-server")])


def test_parse_completion_takes_ids_and_logprobs():
    body = {"tokens": [5, 7, 2], "stop_type": "eos",
            "completion_probabilities": [{"id": 5, "logprob": -0.25, "top_logprobs": []},
                                         {"id": 7, "logprob": -1.5}, {"id": 2, "logprob": -0.125}]}
    assert llamacpp_server.parse_completion(body) == ([5, 7, 2], [-0.25, -1.5, -0.125], "eos")
    # measured: llama-server can leave a token's entry out of completion_probabilities; the ids stay, the
    # log-probs cannot be paired with them
    unpaired = {**body, "tokens": [142, 5, 7, 2]}
    assert llamacpp_server.parse_completion(unpaired) == ([142, 5, 7, 2], None, "eos")
    with pytest.raises(ValueError, match="n_probs"):
        llamacpp_server.parse_completion({"tokens": [5], "content": "x"})


def test_mismatch_stats_hand_computed():
    # rows: learner - sampler = [0, +1] and [-1]; weights min(e^d, 2) = [1, 2 (capped), e^-1]
    s = bench_llamacpp.mismatch_stats([[-1.0, -2.0], [-0.5]], [[-1.0, -1.0], [-1.5]], cap=2.0)
    assert s["tokens"] == 3
    assert s["mean_abs_dlogp"] == pytest.approx(2 / 3)
    assert s["max_abs_dlogp"] == pytest.approx(1.0)
    assert s["mean_tis_weight"] == pytest.approx((1 + 2 + math.exp(-1)) / 3)
    assert s["share_capped"] == pytest.approx(1 / 3)
    assert s["share_below_half"] == pytest.approx(1 / 3)  # e^-1 = 0.37
    k3 = (0.0 + (math.e - 1 - 1) + (math.exp(-1) - 1 + 1)) / 3  # r - 1 - log r
    assert s["mean_k3_kl"] == pytest.approx(k3)
    same = bench_llamacpp.mismatch_stats([[-0.3, -2.0]], [[-0.3, -2.0]], cap=2.0)
    assert (same["mean_abs_dlogp"], same["mean_k3_kl"], same["mean_tis_weight"], same["share_capped"]) == (0, 0, 1, 0)
    with pytest.raises(ValueError, match="length"):
        bench_llamacpp.mismatch_stats([[-1.0]], [[-1.0, -2.0]], cap=2.0)
    with pytest.raises(ValueError, match="no tokens"):
        bench_llamacpp.mismatch_stats([[]], [[]], cap=2.0)


def test_write_f32_gguf_dequantizes_every_tensor_and_keeps_the_metadata(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType, quants

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 64)).astype(np.float32)  # two Q8_0 blocks of 32 per row
    norm = rng.standard_normal(8).astype(np.float32)
    q = quants.quantize(weight, GGMLQuantizationType.Q8_0)
    src = tmp_path / "m.gguf"
    w = GGUFWriter(src, "llama")
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"])
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = llamacpp_gguf.write_f32_gguf(src, tmp_path / "m-f32.gguf")
    assert out == tmp_path / "m-f32.gguf" and not (tmp_path / "m-f32.part").exists()
    r = GGUFReader(out)
    tensors = {t.name: t for t in r.tensors}
    assert {t.tensor_type for t in r.tensors} == {GGMLQuantizationType.F32}
    dq = quants.dequantize(q, GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(4, 64), dq)
    assert not np.array_equal(dq, weight)  # Q8_0 rounded the weights: the copy is of the stored values
    assert np.array_equal(np.asarray(tensors["blk.0.attn_norm.weight"].data), norm)
    assert r.fields["general.file_type"].contents() == LlamaFileType.ALL_F32
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 1
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "<|im_end|>"]
    assert r.fields["tokenizer.chat_template"].contents() == "{{ messages }}"


def test_base_config_dir_drops_the_gguf_quantization_config(tmp_path):
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    out = llamacpp_gguf.base_config_dir(model, tmp_path / "base")
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    assert (out / "tokenizer.json").resolve() == (model / "tokenizer.json").resolve()
    assert not (out / "model.safetensors").exists()  # the converter needs the config only
