"""The ``selfrl`` console script.

    selfrl run [--config FILE] [flags]     run the self-improvement loop
    selfrl run --resume RUN_DIR            continue a stopped run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

RUN_FLAGS = {
    # flag: (dotted config key, type, help)
    "--model": ("model.name", str, "Hugging Face causal LM id or local path (default: embedded SmolLM2-135M-Instruct)"),
    "--task": ("task.source", str, "task source name, e.g. chain_sum, basic_arithmetic, rg:<dataset>"),
    "--preset": ("preset", str, "reward preset: verified | label-free"),
    "--iterations": ("iterations", int, "total rollout + update cycles of the run (with --resume: the new total)"),
    "--num-prompts": ("num_prompts", int, "tasks per iteration"),
    "--num-generations": ("num_generations", int, "samples per task (GRPO group size)"),
    "--learning-rate": ("train.learning_rate", float, "AdamW learning rate"),
    "--beta": ("train.beta", float, "KL coefficient to the reference model"),
    "--temperature": ("rollout.temperature", float, "sampling temperature"),
    "--lora-r": ("lora.r", int, "LoRA rank"),
    "--val-size": ("gate.val_size", int, "held-out tasks"),
    "--eval-every": ("gate.eval_every", int, "updates between validations"),
    "--run-dir": ("run_dir", str, "output folder"),
    "--seed": ("seed", int, "random seed"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfrl", description="Continual self-improvement of LLM agents by online RL.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the self-improvement loop")
    r.add_argument("--config", help="TOML config file (see configs/)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue the run stored in RUN_DIR")
    for flag, (_, typ, help_) in RUN_FLAGS.items():
        r.add_argument(flag, type=typ, help=help_)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input)."""
    args = _parser().parse_args(argv)
    # Nothing is fetched from a model hub while a run goes; HF_HUB_OFFLINE=0 allows it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # A deprecation inside transformers, raised on every run; not ours to fix.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from selfrl.config import ConfigError, load_config
    from selfrl.model import ModelLoadError

    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in RUN_FLAGS.items()}
    base = None
    if args.resume:
        overrides["run_dir"] = args.resume
        stored = Path(args.resume) / "config.json"
        if stored.exists() and not args.config:
            base = json.loads(stored.read_text())  # resume with the run's own settings
    try:
        cfg = load_config(args.config, overrides, base)
        from rich.console import Console

        from selfrl.loop import run
        from selfrl.progress import RichProgress

        with RichProgress(cfg.iterations, Console(stderr=True)) as progress:
            result = run(cfg, resume=bool(args.resume), progress=progress)
    except (ConfigError, ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfrl: interrupted", file=sys.stderr)
        return 130
    print(f"held-out success: base {result.base_success:.3f} -> final {result.final_success:.3f} "
          f"(version {result.final_version})")
    print(f"report: {result.summary['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
