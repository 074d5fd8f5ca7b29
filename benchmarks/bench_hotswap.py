"""Hot-swap: time to serve a new adapter version against a full reload of the model, and the bytes that move.

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_hotswap.py   # real model, ~1 min
    .venv/bin/python benchmarks/bench_hotswap.py --tiny                                    # seconds

Measured, each a median over ``--repeats`` (after one warm-up):

* ``tensor copy only``: the floor, ``copy_`` of each LoRA tensor into its parameter;
* ``swap from memory``: ``Engine.swap`` of a state dict already in memory (the in-place
  copy of the LoRA tensors, with its key/shape check);
* ``load + swap``: reading the version's ``adapter_model.safetensors`` from disk, then
  ``Engine.swap`` (what serving a newly saved version costs);
* ``full reload``: ``load_model`` of the base model from its (warm) safetensors cache plus
  ``PeftModel.from_pretrained`` of the version (what a server without hot-swap would do).

A check follows: the logits after the swap equal those of the fully reloaded model.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, command_line, envelope, finish, model_name, print_table, timed  # noqa: E402


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (bytes)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> dict:
    args = base_parser(__doc__).parse_args(argv)
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from selfrl.config import load_config
    from selfrl.engines.reference import Engine
    from selfrl.model.load import build_policy
    from selfrl.model.load import load_model, resolve_model_path

    result = envelope(args, command_line("bench_hotswap.py", argv))
    work = Path(tempfile.mkdtemp(prefix="bench-hotswap-"))
    name = model_name(args, work)
    cfg = load_config(overrides={"model.name": name})
    model, tok = build_policy(cfg)
    engine = Engine(model, tok)
    # a "trained" version: random LoRA B (peft starts B at 0, which would make the check vacuous)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    version = work / "v1"
    model.save_pretrained(version)
    new_state = load_file(str(version / "adapter_model.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    old_state = {k: v.clone() for k, v in new_state.items()}
    for v in old_state.values():
        v.zero_()
    flip = [0]

    def swap_memory():
        flip[0] += 1
        return engine.swap(new_state if flip[0] % 2 else old_state, flip[0])

    def load_and_swap():
        flip[0] += 1
        return engine.swap(load_file(str(version / "adapter_model.safetensors")), flip[0])

    def full_reload():
        base, _ = load_model(name)
        return PeftModel.from_pretrained(base, str(version))

    # the floor: the same tensors copied in place with no peft call and no check
    params = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    missing = sorted(new_state.keys() - params.keys())
    if missing:
        raise RuntimeError(f"LoRA parameters not found by name: {missing[:3]}")

    @torch.no_grad()
    def copy_only():
        flip[0] += 1
        for k, v in (new_state if flip[0] % 2 else old_state).items():
            params[k].copy_(v)

    t_copy, _ = timed(copy_only, args.repeats, warmup=1)
    t_mem, _ = timed(swap_memory, args.repeats, warmup=1)
    t_disk, _ = timed(load_and_swap, args.repeats, warmup=1)
    t_full, reloaded = timed(full_reload, args.repeats, warmup=1)
    engine.swap(new_state, 99)
    ids = torch.tensor([tok("What is 17 + 25?")["input_ids"]])
    with torch.no_grad():
        same = torch.allclose(model(input_ids=ids).logits, reloaded.eval()(input_ids=ids).logits, atol=1e-5)
    lora_bytes = sum(v.numel() * v.element_size() for v in new_state.values())
    model_dir = Path(resolve_model_path(name))
    rows = [
        ["tensor copy only (floor: no peft call, no check)", t_copy.fmt(".3g"), f"{lora_bytes / 1e6:.1f} MB",
         f"{t_copy.median / t_mem.median:.2f}"],
        ["swap from memory (Engine.swap)", t_mem.fmt(".4f"), f"{lora_bytes / 1e6:.1f} MB copied in place", "1"],
        ["load version from disk + swap", t_disk.fmt(".4f"), f"{dir_bytes(version) / 1e6:.1f} MB read",
         f"{t_disk.median / t_mem.median:.1f}"],
        ["full reload (model + adapter)", t_full.fmt(".3f"),
         f"{(dir_bytes(model_dir) + dir_bytes(version)) / 1e6:.1f} MB read",
         f"{t_full.median / t_mem.median:.0f}"],
    ]
    result.update({
        "model": name, "lora_r": cfg.lora.r, "copy_only_s": t_copy, "swap_memory_s": t_mem, "load_and_swap_s": t_disk, "full_reload_s": t_full,
        "lora_tensor_bytes": lora_bytes, "adapter_folder_bytes": dir_bytes(version),
        "model_folder_bytes": dir_bytes(model_dir), "num_lora_tensors": len(new_state),
        "ratio_full_reload_over_load_and_swap": t_full.median / t_disk.median,
        "ratio_full_reload_over_swap_memory": t_full.median / t_mem.median, "logits_match_after_swap": bool(same),
    })
    print_table(f"hot-swap, LoRA r={cfg.lora.r} ({len(new_state)} tensors), seconds: median [min, max] of {args.repeats}",
                ["path", "seconds", "bytes", "x swap from memory"], rows)
    print(f"full reload / (load + swap) = {result['ratio_full_reload_over_load_and_swap']:.1f}; "
          f"logits after swap match a full reload: {same}")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {finish(result, 'hotswap', args.out)}")
    return result


if __name__ == "__main__":
    main()
