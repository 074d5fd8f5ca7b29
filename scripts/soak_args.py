"""The soak's flags (``scripts/soak.py``), each checked before anything starts, and the two
configs made of them: the simulated users' (:func:`simulate_config`, in the phases of
:data:`PHASES`) and the server's (:func:`serve_toml`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_server import FAMILIES, LEARNING_RATE, MAX_KL, SERVE_TOML, families_toml, val_size_of  # noqa: E402

FAULTS = ("collapse", "nan_loss", "kill", "disk")
RSS_WARMUP_MIN = 15.0  # --rss-warmup-min's default: minutes of a server process before its RSS growth is measured
KEEP_PROMOTED = 3  # --keep-promoted's default where --keep-newest keeps some versions (0 keeps every one)
MIN_SAMPLES = 5  # samples of the timeline a run must hold at least (--sample-s against --minutes)


class Help(argparse.RawTextHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring's lines as they are, and each flag's default after its help (a flag
    whose default is None says in its help what it does when not given)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def out_problem(out: Path, empty: bool = True) -> str | None:
    """Why ``out`` cannot be the soak's folder (a file, a folder not empty where ``empty``, no
    folder can be made there, or one not writable), or None."""
    if out.exists():
        if not out.is_dir():
            return "is a file, not a folder; give a new folder"
        if empty and any(out.iterdir()):
            return "is not empty; give a new folder"
        where = out
    else:
        where = next(p for p in out.parents if p.exists())
        if not where.is_dir():
            return f"cannot be made: {where} is a file, not a folder"
    try:  # a folder made and removed: os.access says yes to root, and to a read-only or virtual file system
        os.rmdir(tempfile.mkdtemp(prefix=".soak-probe-", dir=where))
    except OSError as e:
        return f"cannot be written: {where} is not writable here ({e.strerror or e})"
    return None


def parse_args(argv=None, description: str = "The soak.") -> argparse.Namespace:
    """The soak's flags (``description``: the help's text above them), each checked before anything starts: a value out of its range, flags that
    do not fit together, or a config the simulator or the server would refuse exit with a usage
    error (code 2) naming the flag."""
    from selfrl.config import SECONDS_MAX, SEED_MAX
    from selfrl.config.sections import MAX_VAL
    from selfrl.config.simulate import MAX_ARRIVALS_PER_HOUR, MAX_CONCURRENCY
    from soak_rss import RSS_MIN_SPAN_MIN

    p = argparse.ArgumentParser(description=description, formatter_class=Help)
    p.add_argument("--minutes", type=float, default=90.0, help="real minutes of traffic (the faults fall inside)")
    p.add_argument("--out", default="runs/soak",
                   help="folder of the run, the logs, the timeline, the figure, the table (new or empty)")
    p.add_argument("--tiny", action="store_true", help="serve the tests' tiny random model instead of the embedded one")
    p.add_argument("--model", default="embedded:smollm2-135m-instruct", help="the served model (without --tiny)")
    p.add_argument("--seed", type=int, default=0, help="the users' seed and the faults' times")
    p.add_argument("--concurrency", type=int, default=4, help="users in flight at once")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"which faults to inject, each once, of {', '.join(FAULTS)} (at least one)")
    p.add_argument("--sample-s", type=float, default=10.0,
                   help=f"real seconds between two samples of the timeline (at least {MIN_SAMPLES} in the run)")
    p.add_argument("--day-s", type=float, default=1440.0, help="real seconds one simulated day lasts")
    p.add_argument("--arrivals-per-hour", type=float, default=30.0, help="conversations per simulated hour")
    p.add_argument("--val-size", type=int, default=None,
                   help="held-out tasks of every family (default: each family's own, soak_server.FAMILIES: function "
                        "calling 96, the others 12): the server validates every version on them, no user asks them, "
                        "and champion and base are compared on them at the end")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="each family's no-forgetting tolerance (the server's gate and the report's check)")
    p.add_argument("--rss-warmup-min", type=float, default=None,
                   help=f"RSS growth is measured after this many minutes of each server process, over at least "
                        f"{RSS_MIN_SPAN_MIN:g} more, so a run "
                        f"measures it only with --minutes >= this + "
                        f"{RSS_MIN_SPAN_MIN:g}; given, it must fit the run (default: {RSS_WARMUP_MIN:g}, and a run "
                        f"shorter than {RSS_WARMUP_MIN + RSS_MIN_SPAN_MIN:g} min "
                        f"reports RSS growth not measured)")
    p.add_argument("--disk-mb", type=int, default=512,
                   help="size of the tmpfs the run directory lives on (with the disk fault: at most half the memory)")
    p.add_argument("--disk-hold-s", type=float, default=30.0, help="seconds the disk stays nearly full")
    p.add_argument("--outage-s", type=float, default=5.0, help="seconds the server stays down after kill -9")
    p.add_argument("--keep-newest", type=int, default=3, help="the server's retention.keep_newest")
    p.add_argument("--keep-promoted", type=int, default=None,
                   help=f"the server's retention.keep_promoted (0: every promoted version's folder stays; default: "
                        f"{KEEP_PROMOTED} with --keep-newest >= 1, else 0)")
    p.add_argument("--keep-pruned", action="store_true",
                   help="move pruned folders to adapters/.pruned (on the same disk) instead of deleting them")
    args = p.parse_args(argv)
    given = args.faults
    args.faults = [f for f in args.faults.split(",") if f]
    if bad := [f for f in args.faults if f not in FAULTS]:
        p.error(f"unknown faults {bad}; valid: {', '.join(FAULTS)}")
    if not args.faults:
        p.error(f"--faults must name at least one fault (a soak is its faults), got {given!r}; valid: {', '.join(FAULTS)}")
    if twice := sorted({f for f in args.faults if args.faults.count(f) > 1}):
        p.error(f"--faults names {', '.join(twice)} more than once, got {given!r}; each fault is injected once")
    if args.tiny and args.model != p.get_default("model"):
        p.error(f"--model applies only without --tiny (which serves the tests' tiny model), got --model {args.model}: "
                "leave out one of them")
    warmup_given = args.rss_warmup_min is not None
    if not warmup_given:
        args.rss_warmup_min = RSS_WARMUP_MIN
    inf = float("inf")
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    ranges = (  # (flag, low, high, whether the low end is excluded, what it is)
        ("--minutes", 0, SECONDS_MAX / 60, True, "real minutes of traffic, a year at most"),
        ("--seed", 0, SEED_MAX, False, "the simulator's seed"),
        ("--concurrency", 1, MAX_CONCURRENCY, False, "users in flight at once"),
        ("--sample-s", 0, inf, True, "seconds between two samples"),
        ("--day-s", 0, SECONDS_MAX, True, "real seconds a simulated day lasts"),
        ("--arrivals-per-hour", 0, MAX_ARRIVALS_PER_HOUR, True, "conversations per simulated hour"),
        ("--val-size", 1, MAX_VAL, False, "held-out tasks of every family"),
        ("--tolerance", 0, 1, False, "a drop in held-out success, a share"),
        ("--rss-warmup-min", 0, inf, False, "minutes"),
        ("--disk-mb", 64, memory_mb // 2 if "disk" in args.faults else inf, False,
         "MB of tmpfs: the run directory, its versions and the store must fit"
         + ("; the disk fault fills it, in memory: at most half of this machine's" if "disk" in args.faults else "")),
        ("--disk-hold-s", 0, inf, False, "seconds"),
        ("--outage-s", 0, inf, False, "seconds"),
        ("--keep-newest", 0, 10**6, False, "versions; 0 keeps every one"),
        ("--keep-promoted", 0, 10**6, False, "promoted versions; 0 keeps every one"),
    )
    for flag, lo, hi, open_low, what in ranges:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:  # --val-size not given: each family's own
            continue
        if not ((lo < value) if open_low else (lo <= value)) or not value < inf or not value <= hi:  # NaN fails too
            hi = int(hi) if hi != inf and hi == int(hi) else hi  # 525600, not 525600.0 or 5.256e+05
            valid = (f"finite and > {lo}" if open_low else f"finite and >= {lo}") if hi == inf else \
                f"in ({lo}, {hi}]" if open_low else f"in [{lo}, {hi}]"
            p.error(f"{flag} must be {valid} ({what}), got {value}")
    needs_fault = (("disk_mb", "disk"), ("disk_hold_s", "disk"), ("outage_s", "kill"))  # a flag of one fault's
    for name, fault in needs_fault:
        if fault not in args.faults and getattr(args, name) != p.get_default(name):
            p.error(f"--{name.replace('_', '-')} applies only with the {fault} fault (--faults {given}): add {fault} to "
                    f"--faults, or leave --{name.replace('_', '-')} out")
    if args.keep_pruned and args.keep_newest == 0:
        p.error("--keep-pruned applies only with --keep-newest >= 1 (--keep-newest 0 keeps every version, so none is "
                "pruned): raise --keep-newest, or leave --keep-pruned out")
    seconds = args.minutes * 60
    needs = {"--disk-hold-s": (args.disk_hold_s, args.disk_hold_s < seconds or "disk" not in args.faults),  # a fault
             "--outage-s": (args.outage_s, args.outage_s < seconds or "kill" not in args.faults),  # outlasting the run
             "--sample-s": (args.sample_s * MIN_SAMPLES, args.sample_s <= seconds / MIN_SAMPLES)}  # holds it past it
    for flag in ("--disk-hold-s", "--outage-s"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not needs[flag][1] and value != p.get_default(flag[2:].replace("-", "_")):
            p.error(f"{flag} must be shorter than the run (--minutes {args.minutes:g} = {seconds:g} s), got {value:g}")
    if not needs["--sample-s"][1] and args.sample_s != p.get_default("sample_s"):
        p.error(f"--sample-s {args.sample_s:g} leaves fewer than {MIN_SAMPLES} samples in the run (--minutes "
                f"{args.minutes:g} = {seconds:g} s): lower --sample-s to at most {seconds / MIN_SAMPLES:g} "
                "or lengthen --minutes")
    if short := [flag for flag, (_, fits) in needs.items() if not fits]:  # only flags left at their defaults
        p.error(f"--minutes {args.minutes:g} ({seconds:g} s) is too short for the default "
                + ", ".join(f"{f} {getattr(args, f[2:].replace('-', '_')):g}" for f in short)
                + f" (each fault's hold must end within the run, which holds {MIN_SAMPLES} samples): lengthen --minutes"
                f" to more than {max(needs[f][0] for f in short) / 60:g}, or lower {' and '.join(short)}")
    if warmup_given and args.minutes < args.rss_warmup_min + RSS_MIN_SPAN_MIN:
        p.error(f"--rss-warmup-min {args.rss_warmup_min:g} leaves no RSS growth to measure in the run (--minutes "
                f"{args.minutes:g}): the slope needs {RSS_MIN_SPAN_MIN:g} min after the warm-up; lengthen --minutes to "
                f"at least {args.rss_warmup_min + RSS_MIN_SPAN_MIN:g}, or leave --rss-warmup-min out (a short run then "
                "reports RSS growth not measured)")
    if args.keep_promoted is None:
        args.keep_promoted = KEEP_PROMOTED if args.keep_newest else 0
    elif args.keep_promoted and not args.keep_newest:
        p.error(f"--keep-promoted {args.keep_promoted} applies only with --keep-newest >= 1 (--keep-newest 0 keeps "
                "every version): raise --keep-newest, or leave --keep-promoted out")
    if why := out_problem(Path(args.out).absolute()):
        p.error(f"--out {args.out} {why}")
    check_configs(p, args)
    return args


# The simulator's and the server's settings, and the flags they are made of: a config they refuse names the setting.
FLAGS_OF = (("heldout_size", ("--val-size",)), ("val_size", ("--val-size",)), ("tolerance", ("--tolerance",)),
            ("keep_newest", ("--keep-newest",)), ("keep_promoted", ("--keep-promoted",)),
            ("concurrency", ("--concurrency",)), ("seed", ("--seed",)), ("arrivals_per_hour", ("--arrivals-per-hour",)),
            ("max_seconds", ("--minutes",)), ("window_s", ("--minutes", "--day-s")),
            ("duration_s", ("--minutes", "--day-s")), ("max_delay_s", ("--minutes", "--day-s")), ("day_s", ("--day-s",)))


def check_configs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The simulator's config and the server's, built from ``args`` and checked as they check
    them (``SimulateConfig.validate``, its families built; ``load_serve_config`` and each
    family's environment and held-out set) before anything starts; a refusal is a usage error
    naming the flags behind the setting."""
    from selfrl.config import ConfigError
    from selfrl.serve.families import check_family_sources
    from selfrl.serve.main import load_serve_config
    from selfrl.simulate.families import build_families

    def refuse(who: str, e: Exception) -> None:
        flags = next((flags for key, flags in FLAGS_OF if key in str(e)), ())
        given = " with ".join(f"{f} {getattr(args, f[2:].replace('-', '_'))}" for f in flags) or "these flags"
        p.error(f"{who} refuses {given}: {e}")

    try:
        build_families(simulate_config(args, "http://127.0.0.1:8000", args.minutes, Path(args.out)))
    except (ConfigError, ValueError) as e:
        refuse("the simulator", e)
    with tempfile.TemporaryDirectory(prefix="soak-flags-") as d:
        toml = Path(d) / "serve.toml"
        toml.write_text(serve_toml(args, Path(d) / "run", 8000, "the-model"))
        try:
            check_family_sources(load_serve_config(str(toml), {}))
        except (ConfigError, ValueError) as e:
            refuse("the server", e)


# The schedule: (share of the run, arrival weights). Arithmetic alone first (learned within minutes),
# then function calling joins, then the web; after that the mix keeps shifting among the three.
# Every family has joined by 15 % of the run (13.5 of 90 minutes), inside the RSS warm-up, so that
# the memory measured after it is that of one steady set of families, and the two slow families
# get most of the run to learn in.
PHASES: tuple[tuple[float, dict[str, float]], ...] = (
    (0.08, {"arithmetic": 1.0}),
    (0.07, {"arithmetic": 0.5, "function_calling": 0.5}),
    (0.40, {"arithmetic": 0.2, "function_calling": 0.55, "web": 0.25}),
    (0.45, {"arithmetic": 0.3, "function_calling": 0.5, "web": 0.2}),
)


def simulate_config(args, url: str, minutes: float, out: Path):
    """The users: three families in the phases of :data:`PHASES`, spread over ``minutes`` real minutes."""
    from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig

    tokens = 16 if args.tiny else 96
    families = [FamilySettings(f.name, f.source, dict(f.options), users=20, max_turns=f.max_turns,
                               max_tokens=tokens if args.tiny or f.max_tokens is None else f.max_tokens,
                               tool_choice=f.tool_choice, heldout_size=val_size_of(f, args.val_size),
                               heldout_seed=f.val_seed)
                for f in FAMILIES]  # the server's held-out sets (families_toml): never asked
    sim_span = minutes * 60.0 * 86400.0 / args.day_s  # simulated seconds the traffic lasts
    cfg = SimulateConfig(
        base_url=url, seed=args.seed, max_requests=10**7, max_seconds=minutes * 60.0, day_s=args.day_s,
        arrivals_per_hour=args.arrivals_per_hour, window_s=sim_span / 10, concurrency=args.concurrency,
        timeout_s=120.0, out_dir=str(out), group_by="family",  # one learner group per family: its mean is the baseline
        families=families, phases=[PhaseSettings(share * sim_span, dict(w)) for share, w in PHASES])
    cfg.users.max_delay_s = min(8 * 3600.0, sim_span / 4)  # judgements reach the server within the run
    return cfg.validate()


def serve_toml(a: argparse.Namespace, run_dir: Path, port: int, model: str) -> str:
    """The server's config for the soak's flags ``a`` (``--tiny``: the tiny model's smaller settings)."""
    tiny = a.tiny
    return SERVE_TOML.format(
        run_dir=run_dir, port=port, model=model, tokens=16 if tiny else 96, lora_r=4 if tiny else 8,
        gate_batch=12 if tiny else 24, families=families_toml(a.val_size, a.tolerance),
        min_batch=8 if tiny else 16, max_batch=16 if tiny else 64,
        micro_batch_tokens=512 if tiny else 2048, checkpointing="true",
        feedback_wait_s=5.0 if tiny else 60.0, max_kl=0.1 if tiny else MAX_KL, keep_newest=a.keep_newest,
        keep_promoted=a.keep_promoted, delete=str(not a.keep_pruned).lower(),
        lr=1e-3 if tiny else LEARNING_RATE)
