"""Peak memory and seconds of one learner update on long rows, per micro-batch token budget and gradient checkpointing.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python benchmarks/bench_learner_memory.py            # embedded model, minutes
    .venv/bin/python benchmarks/bench_learner_memory.py --tiny --rows 6 --prompt-tokens 40      # seconds

Every setting (``train.micro_batch_tokens`` from ``--budgets`` crossed with
``train.gradient_checkpointing`` from ``--checkpointing``) runs in a process of its own, one
after the other, so that each has its own peak resident size. Each process builds the policy
as ``selfrl serve`` does, on the CPU (:func:`selfrl.model.load.build_policy` on a ``ServeConfig``:
the model, a LoRA of rank ``--lora-r`` on every linear layer, seeded, so every process starts from
the same weights) and the learner as serve's background learner does, then runs ONE
:meth:`selfrl.rl.learner.Learner.step` on the same synthetic rows: ``--rows`` rows (seed
``--seed``) of ``--prompt-tokens`` prompt tokens, the first ``--shared-prefix`` of them the same in
every row (0: every row its own prompt, the worst case), and ``--completion-tokens`` completion
tokens ending in EOS, with advantages +1, -1, +1, ... (rewards 1, 0, ...). The sampler's log-probs
are ``-log(vocabulary size)``; the update's cost does not depend on them.

The serve defaults hold otherwise (``beta`` 0.02, so a reference pass runs; TIS; the ``dapo``
loss; ``--micro-batch-size`` rows at most per micro-batch, the config's 8 by default), except
that the anomaly skips on the KL and the gradient norm are off: random rows may set them off,
and this measures memory, not learning. An update that is skipped anyway is an error.

Reported per setting: the micro-batches the update ran (forward and backward passes), the
resident size when the update starts (the model, its adapter and the rows), the peak resident
size during the update (Linux: ``VmHWM`` reset just before it through ``/proc/self/clear_refs``,
so loading the model does not count; elsewhere the process's ``ru_maxrss``), both over the first
setting's, the update's seconds (median [min, max] of ``--repeats`` updates from the same
starting weights and a fresh optimizer; the peak is the first update's, and the first update's
seconds include the process's one-time costs), and the largest absolute
difference of the LoRA weights after the update from the first setting's, beside how far the
first setting's update moved them: micro-batches and checkpointing change memory and time, never
the update.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REAL_MODEL, Stats, at_least, base_parser, command_line, envelope, finish, model_name,  # noqa: E402
                    print_table, run_child)

NAME = "learner_memory"
GB = 1e9


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers >= 0, at least one, no repeats.

    >>> int_list("0,2048, 8192")
    [0, 2048, 8192]
    """
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must be comma-separated distinct integers >= 0, got {text!r}")
    return values


def on_off_list(text: str) -> list[bool]:
    """An argparse ``type``: a comma-separated list of ``off`` and ``on`` (False, True), no repeats.

    >>> on_off_list("off,on")
    [False, True]
    """
    words = [x.strip() for x in text.split(",") if x.strip()]
    if not words or set(words) - {"off", "on"} or len(set(words)) != len(words):
        raise argparse.ArgumentTypeError(f"must be off, on or off,on, got {text!r}")
    return [w == "on" for w in words]


def setting_name(budget: int, checkpointing: bool) -> str:
    """The row label of a setting.

    >>> setting_name(0, False), setting_name(2048, True)
    ('micro_batch_tokens=0, checkpointing off', 'micro_batch_tokens=2048, checkpointing on')
    """
    return f"micro_batch_tokens={budget}, checkpointing {'on' if checkpointing else 'off'}"


def expected_micro_batches(rows: int, row_tokens: int, micro_batch_size: int, budget: int) -> int:
    """Micro-batches of ``rows`` rows of ``row_tokens`` tokens each under ``train.micro_batch_size``
    and ``train.micro_batch_tokens`` (0: no budget; a row longer than the budget goes alone).

    >>> [expected_micro_batches(24, 796, 8, budget) for budget in (0, 2048, 8192, 500)]
    [3, 12, 3, 24]
    """
    per = micro_batch_size if budget == 0 else max(1, min(micro_batch_size, budget // row_tokens))
    return math.ceil(rows / per)


def synthetic_rows(vocab_size: int, eos_id: int, special_ids: list[int], rows: int, prompt_tokens: int,
                   completion_tokens: int, shared_prefix: int = 0, seed: int = 0) -> list:
    """``rows`` scored trajectories of ``prompt_tokens + completion_tokens`` tokens (T) each.

    Token ids are drawn uniformly (``torch.Generator`` seeded with ``seed``) from the ids below
    ``vocab_size`` that are not in ``special_ids``; the first ``shared_prefix`` prompt tokens are
    the same in every row; each completion ends in ``eos_id``. ``completion_mask`` is 1 on the
    completion, ``logprobs`` ``-log(vocab_size)`` there (0 on the prompt); rows alternate
    advantage +1 / reward 1 and advantage -1 / reward 0, all in one group.

    Raises:
        ValueError: a size below 1, ``shared_prefix`` not in [0, ``prompt_tokens``], or no id to draw.
    """
    import torch

    from selfrl.core.trajectory import Trajectory

    if min(rows, prompt_tokens, completion_tokens) < 1 or not 0 <= shared_prefix <= prompt_tokens:
        raise ValueError("rows, prompt_tokens and completion_tokens must be >= 1 and shared_prefix in [0, "
                         f"prompt_tokens]; got {rows}, {prompt_tokens}, {completion_tokens}, {shared_prefix}")
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(special_ids)), dtype=torch.long)  # (V',)
    if not len(allowed):
        raise ValueError(f"no token id below {vocab_size} that is not special")
    gen = torch.Generator().manual_seed(seed)
    T = prompt_tokens + completion_tokens
    ids = allowed[torch.randint(len(allowed), (rows, T), generator=gen)]  # (rows, T)
    ids[:, :shared_prefix] = ids[0, :shared_prefix]
    ids[:, -1] = eos_id
    sampled = -math.log(vocab_size)
    out = []
    for i in range(rows):
        sign = 1.0 if i % 2 == 0 else -1.0
        out.append(Trajectory(f"task{i}", "bench", 0, prompt_len=prompt_tokens, token_ids=ids[i].tolist(),
                              completion_mask=[0] * prompt_tokens + [1] * completion_tokens,
                              logprobs=[0.0] * prompt_tokens + [sampled] * completion_tokens,
                              reward=(sign + 1) / 2, advantage=sign, num_turns=1))
    return out


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset this process's peak resident size (``VmHWM``) to its current one; False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def rss_bytes() -> float:
    """This process's resident size now (bytes; NaN where ``/proc`` has none)."""
    kb = _status_kb("VmRSS")
    return kb * 1024.0 if kb is not None else math.nan


def peak_bytes(since_reset: bool) -> float:
    """Peak resident size (bytes): ``VmHWM`` after :func:`reset_peak`, else the process's ``ru_maxrss``."""
    from common import peak_rss_bytes

    kb = _status_kb("VmHWM") if since_reset else None
    return kb * 1024.0 if kb is not None else float(peak_rss_bytes())


def serve_config(args: argparse.Namespace, model: str, budget: int, checkpointing: bool, run_dir: str):
    """The ``ServeConfig`` of one setting, validated: serve's defaults, the model, the LoRA rank, the
    seed, the completion limit and the update settings of the flags; the KL and gradient-norm skips off.

    Raises:
        selfrl.core.errors.ConfigError: a setting out of its range (the message names it).
    """
    from selfrl.config.serve import ServeConfig

    cfg = ServeConfig(run_dir=run_dir, max_tokens_default=args.completion_tokens)
    cfg.seed = args.seed
    cfg.model.name = model
    cfg.model.device = "cpu"  # the resident size is what this measures (a GPU's memory is another figure)
    cfg.lora.r = args.lora_r
    cfg.train.micro_batch_size = args.micro_batch_size
    cfg.train.micro_batch_tokens = budget
    cfg.train.gradient_checkpointing = checkpointing
    cfg.train.skip_max_kl = cfg.train.skip_max_grad_norm = 1e9  # memory, not learning: random rows may set them off
    return cfg.validate()


def child(args: argparse.Namespace, model: str, budget: int, checkpointing: bool, out: Path) -> None:
    """One setting: build the policy and learner as serve does, run one update (and ``--repeats`` - 1
    more from the same start, timed only); write its figures to ``out`` (JSON) and the LoRA weights
    after the first update to ``out`` with the suffix ``.safetensors``."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import save_file

    from selfrl.core.memory import trim_heap
    from selfrl.model.load import build_policy
    from selfrl.record.adapters import lora_state
    from selfrl.rl.learner import Learner, kl_reference

    torch.manual_seed(args.seed)
    cfg = serve_config(args, model, budget, checkpointing, str(out.parent / "run"))
    policy, tok = build_policy(cfg)
    context = getattr(policy.config, "max_position_embeddings", None)
    T = args.prompt_tokens + args.completion_tokens
    if context is not None and T > context:
        raise SystemExit(f"--prompt-tokens + --completion-tokens = {T} is beyond the model's context of {context} "
                         "tokens; give shorter rows")
    rows = synthetic_rows(len(tok), tok.eos_token_id, list(tok.all_special_ids), args.rows, args.prompt_tokens,
                          args.completion_tokens, args.shared_prefix, args.seed)
    learner = Learner(policy, cfg.train, cfg.learner.temperature, tok.pad_token_id, cfg.max_completion_length,
                      ref_state=kl_reference(policy, cfg.lora.init_adapter), tokenizer=tok)
    start = lora_state(policy)
    passes = []
    seconds = []
    first = None
    for k in range(args.repeats):
        if k:
            set_peft_model_state_dict(policy, start)
            learner.reset_optimizer()
        gc.collect()
        trim_heap()
        if k == 0:
            rss_start = rss_bytes()
            since_reset = reset_peak()
        count = [0]
        t0 = time.perf_counter()
        result = learner.step(rows, on_micro_batch=lambda: count.__setitem__(0, count[0] + 1))
        seconds.append(time.perf_counter() - t0)
        passes.append(count[0])
        if result.skipped:
            raise SystemExit(f"the update was skipped ({result.reason.value}: {result.note}); nothing was measured")
        if k == 0:
            peak = peak_bytes(since_reset)
            after = lora_state(policy)
            first = result
    moved = max(float((after[key] - start[key]).abs().max()) for key in start)
    save_file({key: v.contiguous() for key, v in after.items()}, str(out.with_suffix(".safetensors")))
    out.write_text(json.dumps({
        "micro_batches": passes[0], "micro_batches_each_repeat": passes, "rss_start_bytes": rss_start,
        "peak_rss_bytes": peak, "peak_since_update_start": since_reset,
        "learner_peak_rss_bytes": first.stats.get("memory/peak_rss_bytes"), "seconds": seconds,
        "max_weight_move": moved, "stats": first.stats, "torch_threads": torch.get_num_threads(),
        "row_tokens": T, "vocab_size": len(tok),
    }))


def settings(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """The (budget, checkpointing) pairs, the first the reference row: ``--budgets`` crossed with
    ``--checkpointing``, in the order given."""
    return [(b, c) for c in args.checkpointing for b in args.budgets]


def parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__)
    p.set_defaults(repeats=1)
    for action in p._actions:
        if action.dest == "repeats":
            action.help = ("updates per setting, each from the same start and timed (median, min, max); the peak is "
                           "the first's (default 1)")
    p.add_argument("--model", choices=("embedded", "tiny"), default=None,
                   help="embedded: SmolLM2-135M (the default); tiny: a random 2-layer model built from a config "
                        "(as --tiny)")
    p.add_argument("--budgets", type=int_list, default=[0, 2048, 8192],
                   help="comma-separated train.micro_batch_tokens values (0: no token budget, micro_batch_size alone); "
                        "the first, with the first --checkpointing value, is the reference row (default 0,2048,8192)")
    p.add_argument("--checkpointing", type=on_off_list, default=[False, True],
                   help="train.gradient_checkpointing values: off, on or off,on (default off,on)")
    p.add_argument("--rows", type=at_least(1), default=24, help="rows in the update (default 24)")
    p.add_argument("--prompt-tokens", type=at_least(1), default=700,
                   help="prompt tokens of each row, e.g. a web agent's turn with two worked examples (default 700)")
    p.add_argument("--completion-tokens", type=at_least(1), default=96,
                   help="completion tokens of each row (default 96)")
    p.add_argument("--shared-prefix", type=at_least(0), default=0,
                   help="leading prompt tokens every row shares (0: none, the worst case; default 0)")
    p.add_argument("--micro-batch-size", type=at_least(1), default=8,
                   help="train.micro_batch_size (default 8, the config's)")
    p.add_argument("--lora-r", type=at_least(1), default=8, help="LoRA rank on every linear layer (default 8)")
    p.add_argument("--seed", type=at_least(0), default=0,
                   help="seeds the rows and the adapter's initialisation (default 0)")
    p.add_argument("--child", nargs=4, metavar=("BUDGET", "CHECKPOINTING", "MODEL", "OUT"), help=argparse.SUPPRESS)
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other (a usage error naming them); resolves ``args.model``."""
    if args.model == "embedded" and args.tiny:
        p.error("--tiny and --model embedded contradict each other; give one of them")
    args.model = "tiny" if args.tiny else (args.model or "embedded")
    args.tiny = args.model == "tiny"
    if args.shared_prefix > args.prompt_tokens:
        p.error(f"--shared-prefix ({args.shared_prefix}) must be at most --prompt-tokens ({args.prompt_tokens})")


def main(argv: list[str] | None = None) -> dict | None:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    if args.child:
        child(args, args.child[2], int(args.child[0]), args.child[1] == "on", Path(args.child[3]))
        return None
    from selfrl.core.errors import ConfigError

    for budget, ckpt in settings(args):  # every setting's config checked before anything runs
        try:
            serve_config(args, REAL_MODEL, budget, ckpt, "unused")
        except ConfigError as e:
            p.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="bench-learner-memory-"))
    model = model_name(args, work)
    from safetensors.torch import load_file

    result = envelope(args, command_line("bench_learner_memory.py", argv)) | {
        "model": model if not args.tiny else "tiny", "rows": args.rows, "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens, "shared_prefix": args.shared_prefix,
        "micro_batch_size": args.micro_batch_size, "lora_r": args.lora_r, "seed": args.seed, "settings": []}
    flags = ["--model", args.model, "--repeats", str(args.repeats), "--rows", str(args.rows),
             "--prompt-tokens", str(args.prompt_tokens), "--completion-tokens", str(args.completion_tokens),
             "--shared-prefix", str(args.shared_prefix), "--micro-batch-size", str(args.micro_batch_size),
             "--lora-r", str(args.lora_r), "--seed", str(args.seed)]
    reference = None
    try:
        for budget, ckpt in settings(args):
            name = setting_name(budget, ckpt)
            out = work / f"{budget}-{'on' if ckpt else 'off'}.json"
            print(f"{name}: running", file=sys.stderr, flush=True)
            switch = "on" if ckpt else "off"
            data = run_child([__file__, *flags, "--child", str(budget), switch, model, str(out)], out)
            weights = load_file(str(out.with_suffix(".safetensors")))
            if reference is None:
                reference = (data, weights)
            data["max_weight_diff"] = max(float((weights[k] - reference[1][k]).abs().max()) for k in weights)
            result["settings"].append({"name": name, "micro_batch_tokens": budget, "gradient_checkpointing": ckpt,
                                       "expected_micro_batches": expected_micro_batches(
                                           args.rows, data["row_tokens"], args.micro_batch_size, budget), **data})
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the tiny model, the rows' weights
    base = result["settings"][0]
    rows = []
    for s in result["settings"]:
        secs, base_secs = Stats.of(s["seconds"]), Stats.of(base["seconds"])
        rows.append([s["name"], str(s["micro_batches"]), f"{s['rss_start_bytes'] / GB:.2f}",
                     f"{s['peak_rss_bytes'] / GB:.2f}",
                     f"{s['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}", secs.fmt(".1f"),
                     f"{secs.median / base_secs.median:.2f}", f"{s['max_weight_diff']:.1e}"])
    print_table(f"One learner update: {args.rows} rows of {args.prompt_tokens} + {args.completion_tokens} tokens "
                f"({result['model']}, LoRA r {args.lora_r}, micro_batch_size {args.micro_batch_size})",
                ["setting", "micro-batches", "RSS at start (GB)", "peak RSS (GB)", "peak / first", "seconds",
                 "seconds / first", "max |weight - first's|"], rows)
    print(f"the first setting's update moved the LoRA weights by at most {base['max_weight_move']:.1e}")
    print(f"wrote {finish(result, NAME, args.out)}")
    return result


if __name__ == "__main__":
    main()
