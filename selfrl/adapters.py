"""Adapter versions on disk: one step-numbered folder per version, written atomically.

Layout: ``<run_dir>/adapters/v000003/`` holds peft's ``adapter_model.safetensors``
and ``adapter_config.json``. A version is written into a hidden temporary
folder, its files fsynced, then renamed into place, so a process killed while
saving leaves either the whole version or nothing: the store never points to a
half-written adapter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file


def version_dir(run_dir: Path, version: int) -> Path:
    """The folder of ``version`` inside ``run_dir``."""
    return Path(run_dir) / "adapters" / f"v{version:06d}"


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_version(model, run_dir: Path, version: int) -> Path:
    """Save the model's active LoRA adapter as ``version``; returns its folder.

    Raises:
        FileExistsError: that version already exists (versions are immutable).
    """
    target = version_dir(run_dir, version)
    if target.exists():
        raise FileExistsError(f"adapter version {version} already exists at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:06d}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_version_state(path: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a saved version, as peft's state dict (for ``Engine.swap``).

    Raises:
        FileNotFoundError: no adapter weights in ``path``.
    """
    f = Path(path) / "adapter_model.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"no adapter weights at {f}")
    return load_file(str(f))


def lora_state(model) -> dict[str, torch.Tensor]:
    """A detached copy of the model's current LoRA tensors (peft's state-dict keys)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
