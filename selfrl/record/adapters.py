"""Adapter versions on disk: one step-numbered folder per version, written atomically.

Layout: ``<run_dir>/adapters/v000003/`` holds peft's ``adapter_model.safetensors``
and ``adapter_config.json``, and ``selfrl_version.json``: the SHA-256 of every
other file, written last. A version is written into a hidden temporary folder,
its files fsynced, then renamed into place and the parent folder fsynced, so a
process killed while saving leaves either the whole version or a hidden
temporary folder. A folder is *complete* only when its marker is there and every
checksum matches (:func:`verify_version`); the loop serves nothing else, and
:func:`stray_dirs` finds what a killed save left behind for the resume to clear.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from selfrl.core import faults
from selfrl.core.atomic import fsync_dir
from selfrl.model.adapter_check import check_adapter
from selfrl.record.rundir import VERSIONS

MARKER = "selfrl_version.json"


class CorruptVersionError(ValueError):
    """A version folder is missing, incomplete, or its files do not match their checksums."""


def version_dir(run_dir: Path, version: int) -> Path:
    """The folder of ``version`` inside ``run_dir`` (the layout of :mod:`selfrl.record.rundir`)."""
    return Path(run_dir) / VERSIONS / f"v{version:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def save_version(model, run_dir: Path, version: int) -> Path:
    """Save the model's active LoRA adapter as ``version``; returns its folder.

    Order: peft's files into a temporary folder, the checksum marker last, fsync,
    rename into place, fsync the parent folder.

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
        faults.point("during_save")
        files = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MARKER).write_text(json.dumps({"version": version, "sha256": files}, indent=1))
        _fsync_tree(tmp)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    faults.point("after_save")
    return target


def verify_version(path: Path) -> str | None:
    """None when the version folder at ``path`` is complete; else why it is not (one line).

    Complete: the marker exists, names ``adapter_model.safetensors`` and the version the
    folder is named after (``v000003``: 3), and every file it names exists with the
    recorded SHA-256 (reads each file once: about 0.03 s for an 18.7 MB adapter).
    """
    path = Path(path)
    marker = path / MARKER
    if not path.is_dir():
        return f"folder {path} is missing"
    if not marker.is_file():
        return f"no completion marker {MARKER} (a save that did not finish, or not a selfrl version)"
    try:
        info = json.loads(marker.read_text())
        files = info["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable completion marker: {e}"
    named = int(path.name[1:]) if path.name[:1] == "v" and path.name[1:].isdigit() else None
    if named is not None and info.get("version", named) != named:  # a folder copied over another version's
        return f"it holds version {info.get('version')}'s files, not version {named}'s"
    if "adapter_model.safetensors" not in files:
        return "the marker names no adapter_model.safetensors"
    for name, digest in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if _sha256(path / name) != digest:
            return f"{name} does not match its checksum"
    return None


def load_version_state(path: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a saved version, as peft's state dict (for ``Engine.swap``).

    Raises:
        CorruptVersionError: ``verify`` and the folder is not complete (see :func:`verify_version`).
        FileNotFoundError: no adapter weights in ``path``.
        selfrl.model.adapter_check.AdapterError: its ``adapter_config.json`` is missing or names an
            adapter selfrl cannot hot-swap (:func:`selfrl.model.adapter_check.check_adapter`).
    """
    if verify and (reason := verify_version(path)) is not None:
        raise CorruptVersionError(f"adapter version at {path} cannot be served: {reason}")
    check_adapter(path)
    f = Path(path) / "adapter_model.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"no adapter weights at {f}")
    return load_file(str(f))


def stray_dirs(run_dir: Path, recorded: set[int]) -> list[Path]:
    """Folders under ``<run_dir>/adapters`` that a killed process left: temporary
    ``.vNNNNNN-*`` folders, and version folders whose number the store does not hold."""
    root = Path(run_dir) / VERSIONS
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        temporary = p.name.startswith(".v")
        unrecorded = p.name.startswith("v") and p.name[1:].isdigit() and int(p.name[1:]) not in recorded
        if temporary or unrecorded:
            out.append(p)
    return out


def quarantine(path: Path) -> Path:
    """Move ``path`` into ``<its parent>/.recovered/`` (kept for inspection, never served); returns the new path."""
    path = Path(path)
    dest = path.parent / ".recovered" / f"{path.name.lstrip('.')}-{time.time_ns()}"
    dest.parent.mkdir(exist_ok=True)
    os.rename(path, dest)
    fsync_dir(path.parent)
    return dest


def lora_state(model) -> dict[str, torch.Tensor]:
    """A detached copy of the model's current LoRA tensors (peft's state-dict keys)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
