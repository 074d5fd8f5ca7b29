"""Which adapters selfrl can train, hot-swap and serve, checked wherever one comes in.

selfrl trains a plain LoRA on the decoder's linear layers and hot-swaps it by copying
the LoRA tensors into the engine's model (``Engine.swap``). An adapter that trains
anything else (the output layer through ``modules_to_save``, embedding rows through
``trainable_token_indices``, a DoRA magnitude, the base layers' biases) or changes the
model's shape (``layer_replication``) would be trained in part and served in part, or
not at all, so it is refused before anything is trained or served.

:func:`check_adapter` reads an adapter folder's ``adapter_config.json`` (no tensor is
loaded) and is called by every place an adapter folder comes in: the starting adapter
of ``selfrl run`` and ``selfrl serve`` (``lora.init_adapter``, in
:func:`selfrl.model.load.build_policy`, before the base weights load), every stored version
that is loaded (a resumed run's champion, a pinned or rolled-back version, a folder
pushed to ``selfrl sampler``: :func:`selfrl.record.adapters.load_version_state`), and a folder
handed to vLLM (:class:`selfrl.engines.vllm.VLLMEngine`). :func:`check_lora_layers`
checks the built model once: LoRA only on linear layers, never on the embedding or
the output layer, and an init adapter that covers the layers ``lora.target_modules``
names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"

# peft LoraConfig fields whose non-default values train or change what a LoRA hot-swap
# does not carry; value: (the default, what the option does, what to do instead)
_REFUSED: dict[str, tuple[Any, str]] = {
    "modules_to_save": (None, "trains whole modules (e.g. the output layer lm_head) besides the LoRA tensors"),
    "trainable_token_indices": (None, "trains rows of the embedding matrix"),
    "use_dora": (False, "is DoRA (a trained magnitude vector per layer)"),
    "lora_bias": (False, "trains a bias on each LoRA B matrix"),
    "layer_replication": (None, "replicates decoder layers (the model's shape changes)"),
    "target_parameters": (None, "puts LoRA on raw parameters (e.g. MoE experts), not on linear layers"),
    "alora_invocation_tokens": (None, "is an activated LoRA (it acts only after its invocation tokens)"),
    "use_qalora": (False, "is QA-LoRA (quantisation-aware pooling of the input)"),
    "use_bdlora": (None, "is a block-diagonal LoRA variant"),
    "velora_config": (None, "is a VeLoRA variant"),
    "monteclora_config": (None, "is a MonteCLoRA variant"),
    "arrow_config": (None, "is an Arrow routing of several LoRAs"),
    "kasa_config": (None, "is a KaSA variant"),
}
_FIX = ("selfrl trains and hot-swaps a plain LoRA on the decoder's linear layers only; retrain the adapter "
        "without it, or merge it into the base model (peft's merge_and_unload, then save_pretrained) and "
        "give the merged folder as model.name")

# names of input-embedding and output layers across common architectures
EMBEDDING_NAMES = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out",
                             "word_embeddings", "shared", "embed_positions", "position_embeddings"})


class AdapterError(ValueError):
    """An adapter selfrl cannot train, hot-swap or serve; the message names the folder,
    the setting, and what to do."""


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    """The JSON object of ``folder/adapter_config.json``.

    Raises:
        AdapterError: no such folder or file, or it is not a JSON object.
    """
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise AdapterError(f"adapter {folder}: not a folder")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter {folder}: no {CONFIG_FILE} (not a peft adapter folder; save one with "
                           "model.save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {folder}: unreadable {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {folder}: {CONFIG_FILE} is not a JSON object")
    return config


def model_identity(name_or_path: str | None) -> str | None:
    """A model's name for comparing two references to it: the last path component, lower
    case, with a Hugging Face cache folder (``models--org--name/snapshots/<hash>``) and
    selfrl's ``embedded:`` prefix read as the name; None for None or "".

    >>> model_identity("HuggingFaceTB/SmolLM2-135M-Instruct"), model_identity("embedded:smollm2-135m-instruct")
    ('smollm2-135m-instruct', 'smollm2-135m-instruct')
    >>> model_identity("/hf/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc123/")
    'qwen2.5-0.5b'
    """
    if not name_or_path:
        return None
    text = str(name_or_path).rstrip("/\\")
    if text.startswith("embedded:"):
        text = text[len("embedded:"):]
    parts = [p for p in text.replace("\\", "/").split("/") if p]
    for p in reversed(parts):
        if p.startswith("models--"):
            return p.split("--")[-1].lower()
    return parts[-1].lower() if parts else None


def check_adapter(folder: str | Path, model_name: str | None = None, lora=None, setting: str = "") -> dict[str, Any]:
    """Refuse an adapter folder selfrl cannot train, hot-swap or serve; returns its config.

    Reads only ``adapter_config.json``. Refused: a ``peft_type`` other than LORA; any of
    the options in ``_REFUSED`` set (``modules_to_save``, ``trainable_token_indices``,
    ``use_dora``, ``lora_bias``, ``layer_replication``, ...); ``bias`` other than "none";
    an embedding or output layer named in ``target_modules``; with ``model_name``, a
    ``base_model_name_or_path`` naming another model (:func:`model_identity`); with
    ``lora`` (a :class:`selfrl.config.LoraSettings`), an ``r``, ``lora_alpha``,
    ``lora_dropout`` or listed ``target_modules`` other than the adapter's (the adapter's
    own shape is what trains, so a different setting would be ignored).

    Args:
        folder: the adapter folder.
        model_name: the base model it must fit (``model.name``), or None not to compare.
        lora: the LoRA settings it must match, or None not to compare.
        setting: the config key the folder came from (for the message), e.g. "lora.init_adapter".

    Raises:
        AdapterError: the first thing refused, in one line that says what to do.
    """
    where = f"{setting} {folder}" if setting else f"adapter {folder}"
    config = read_adapter_config(folder)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not supported; selfrl trains and hot-swaps LoRA "
                           "adapters only (peft.LoraConfig)")
    for key, (default, what) in _REFUSED.items():
        value = config.get(key, default)
        if value not in (default, None, False, [], {}, ""):
            raise AdapterError(f"{where}: {key} = {json.dumps(value)} is not supported: it {what}; {_FIX}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias = {json.dumps(config['bias'])} is not supported: it trains the base "
                           f"layers' biases; {_FIX}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        named = sorted(set(targets) & EMBEDDING_NAMES)
        if named:
            raise AdapterError(f"{where}: target_modules names {', '.join(named)}, an embedding or output layer; "
                               f"{_FIX}")
    base = config.get("base_model_name_or_path")
    if model_name is not None and base and model_identity(base) != model_identity(model_name):
        raise AdapterError(f"{where}: it was trained on {base!r}, but model.name is {model_name!r}; set model.name "
                           f"to the adapter's base model (if both name the same model, set base_model_name_or_path "
                           f"in its {CONFIG_FILE} to {model_name!r})")
    if lora is not None:
        _check_shape(config, lora, where)
    return config


def _check_shape(config: dict[str, Any], lora, where: str) -> None:
    for key in ("r", "lora_alpha", "lora_dropout"):
        if key in config and config[key] != getattr(lora, key):
            raise AdapterError(f"{where}: the adapter has {key} = {config[key]} but lora.{key} is "
                               f"{getattr(lora, key)}; set lora.{key} = {config[key]} (a saved adapter's shape is fixed)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{where}: rank_pattern/alpha_pattern (a rank or alpha per layer) is not supported; {_FIX}")
    mine, theirs = lora.target_modules, config.get("target_modules")
    if isinstance(mine, list) and isinstance(theirs, list) and set(mine) != set(theirs):
        raise AdapterError(f"{where}: the adapter's target_modules are {sorted(theirs)} but lora.target_modules is "
                           f"{sorted(mine)}; set lora.target_modules = {json.dumps(sorted(theirs))}")


def check_lora_layers(model, lora=None) -> None:
    """Refuse a built peft model whose LoRA sits on anything but the decoder's linear layers,
    and, with ``lora`` of an init adapter whose ``target_modules`` is "all-linear", one that
    leaves out a linear layer that setting covers.

    Called by :func:`selfrl.model.load.build_policy` before training starts. Catches what
    :func:`check_adapter` cannot see from names alone: a ``target_modules`` regular
    expression or an architecture's own embedding name.

    Raises:
        AdapterError: the first layer refused, named.
    """
    import torch

    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    special = {id(m) for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None}
    lora_names = set()
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        inner = module.get_base_layer()
        if special & {id(module), id(inner)} or not isinstance(inner, torch.nn.Linear):
            raise AdapterError(f"LoRA on {name} ({type(inner).__name__}) is not supported: selfrl trains and "
                               "hot-swaps LoRA on the decoder's linear layers only, never the embedding or the "
                               "output layer; leave it out of target_modules")
        lora_names.add(name.rsplit(".", 1)[-1])
    if lora is not None and lora.target_modules == "all-linear":
        linear = {name.rsplit(".", 1)[-1] for name, m in base.named_modules()
                  if isinstance(m, torch.nn.Linear) and id(m) not in special and not isinstance(m, LoraLayer)
                  and ".base_layer" not in name and not any(p in ("lora_A", "lora_B") for p in name.split("."))}
        missing = sorted(linear - lora_names)
        if missing:
            raise AdapterError(f"lora.init_adapter: the adapter has no LoRA on {', '.join(missing)}, but "
                               f"lora.target_modules is \"all-linear\"; set lora.target_modules = "
                               f"{json.dumps(sorted(lora_names))} to train the adapter as it is")
