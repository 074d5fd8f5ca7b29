"""Shared helpers of the benchmarks: timing with repeats, machine facts, peak memory,
JSON results, rich tables, and the tiny random model that ``--tiny`` runs use.

Every benchmark is one command (``python benchmarks/bench_<name>.py``) that prints
a table and writes ``benchmarks/results/<name>.json``. Figures are medians over
repeats with min and max, since a 2-core machine is noisy; the load average at
start and end goes into each JSON so a contended measurement can be recognised.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
REAL_MODEL = "embedded:smollm2-135m-instruct"
# --tiny: a rollout batch of 2 prompts x 2 generations of at most 8 tokens, seconds on a CPU
TINY_RUN = {"num_prompts": 2, "num_generations": 2, "rollout.max_new_tokens": 8, "task.num_train": 8,
            "gate.val_size": 2}


@dataclass
class Stats:
    """Median, min and max of repeated measurements (same unit as the values)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Stats":
        """Summarise ``values``.

        >>> Stats.of([3.0, 1.0, 2.0])
        Stats(median=2.0, min=1.0, max=3.0, n=3)

        Raises:
            ValueError: no values.
        """
        if not values:
            raise ValueError("Stats.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, spec: str = ".3g", scale: float = 1.0) -> str:
        """``median [min, max]`` with every value multiplied by ``scale``.

        >>> Stats.of([1.0, 2.0, 4.0]).fmt(".1f")
        '2.0 [1.0, 4.0]'
        """
        m, lo, hi = (format(v * scale, spec) for v in (self.median, self.min, self.max))
        return m if self.n == 1 else f"{m} [{lo}, {hi}]"


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> tuple[Stats, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; returns
    (seconds as :class:`Stats`, the last return value)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return Stats.of(times), out


def machine() -> dict[str, Any]:
    """CPU count, model name (from lscpu), torch version and threads, load average."""
    import torch

    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "gpu": bool(torch.cuda.is_available())}


def loadavg() -> float:
    """One-minute load average (2 cores: above ~1.5 means another job was running)."""
    return os.getloadavg()[0]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_result(name: str, data: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``data`` as ``<out_dir>/<name>.json`` (default ``benchmarks/results``); returns the path."""
    out = Path(out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(obj):
    if isinstance(obj, Stats):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a table with rich (to stdout)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))  # "[min, max]" is text, not rich markup
    for c in columns:
        table.add_column(escape(c))
    for r in rows:
        table.add_row(*[escape(str(x)) for x in r])
    Console(width=160).print(table)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``low``; anything else is a usage error naming
    the flag (``argument --repeats: must be an integer >= 1, got '0'``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def out_folder(text: str) -> Path:
    """An argparse ``type`` for ``--out``: a folder path that is not a file (nor under one), so a
    benchmark is refused at once rather than failing to write after its whole run
    (``argument --out: X is a file, not a folder: give a folder path``); a missing folder passes."""
    from selfrl.record.rundir import NotAFolder, check_folder

    try:
        check_folder(text)
    except NotAFolder as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Path(text)


def base_parser(doc: str, repeats: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--tiny``, ``--out``, and ``--repeats`` where it times a
    figure more than once (``repeats=False``: a benchmark that does not, which then refuses the
    flag rather than ignore it); the description is the first paragraph of ``doc`` (the
    benchmark's docstring), whole sentences."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random model built from a config (seconds; smoke test)")
    if repeats:
        p.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats per figure (median, min, max)")
    p.add_argument("--out", type=out_folder, default=None,
                   help="folder for the JSON result (default benchmarks/results); checked before any work")
    return p


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran ``benchmarks/<script>`` with ``argv`` (None: this process's own arguments).

    >>> command_line("bench_x.py", ["--tiny"])
    'python benchmarks/bench_x.py --tiny'
    """
    return f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])


def envelope(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What every result starts with: the command, the machine, the time and the load."""
    return {"command": command, "tiny": bool(args.tiny), "repeats": getattr(args, "repeats", None), "machine": machine(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "loadavg_start": loadavg()}


def finish(result: dict[str, Any], name: str, out_dir: Path | None) -> Path:
    """Add the end load average (and a ``contended`` flag) and write the result; a ``--tiny``
    run without ``--out`` writes to ``benchmarks/results/tiny/`` (not kept in git), never over a
    measured result of the same name."""
    result["loadavg_end"] = loadavg()
    result["contended"] = max(result["loadavg_start"], result["loadavg_end"]) > 1.5 * (os.cpu_count() or 1) / 2
    if out_dir is None and result.get("tiny"):
        out_dir = RESULTS / "tiny"
    return write_result(name, result, out_dir)


def tiny_model_dir(path: Path) -> str:
    """Save a tiny random 2-layer Llama and byte-level tokenizer (``selfrl.testing``)
    into ``path``; returns it as a model path for ``selfrl.model.load.load_model``."""
    from selfrl.testing import build_tiny_model, build_tiny_tokenizer

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def save_phi(path: Path, hidden: int, layers: int, eos_bias: float = 3.0) -> str:
    """A random Phi (``hidden`` wide, ``layers`` deep, 4 heads, output bias ``eos_bias`` at EOS, seed 0)
    and the tests' tiny tokenizer, saved in ``path`` by :func:`selfrl.testing.save_tiny_phi`;
    returns it as a model path (the learning benchmarks' model)."""
    from selfrl.testing import build_tiny_tokenizer, save_tiny_phi

    return str(save_tiny_phi(path, build_tiny_tokenizer(), 0, eos_bias, hidden_size=hidden,
                             intermediate_size=4 * hidden, num_hidden_layers=layers, num_key_value_heads=4,
                             max_position_embeddings=2048, initializer_range=0.02))


def model_name(args: argparse.Namespace, workdir: Path) -> str:
    """The real embedded model, or a tiny one saved under ``workdir`` with ``--tiny``."""
    return tiny_model_dir(Path(workdir) / "tiny-model") if args.tiny else REAL_MODEL


def bench_config(args: argparse.Namespace, config: Path, prefix: str, tiny: dict[str, Any] | None = None,
                 **overrides: Any):
    """The run config at ``config`` with ``model.name`` = :func:`model_name` (a tiny model saved in a
    fresh temporary folder named ``prefix...`` with ``--tiny``), ``overrides`` (dotted keys) and, with
    ``--tiny``, ``tiny`` (default :data:`TINY_RUN`) on top; a :class:`selfrl.config.RunConfig`."""
    from selfrl.config import load_config

    merged = {"model.name": model_name(args, Path(tempfile.mkdtemp(prefix=prefix))), **overrides}
    if args.tiny:
        merged.update(TINY_RUN if tiny is None else tiny)
    return load_config(config, merged)


def first_batch(cfg) -> tuple[list, list]:
    """(the tasks of ``selfrl run``'s first iteration, each ``cfg.num_generations`` times in a row, the tools)
    of run config ``cfg``: one rollout batch of ``cfg.num_prompts * cfg.num_generations`` trajectories."""
    from selfrl.run.loop import iteration_tasks
    from selfrl.envs import get_env
    from selfrl.core.tools import resolve_tools

    source = get_env(cfg.task.source, **cfg.task.options)
    train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    batch = iteration_tasks(train, 0, cfg.num_prompts, cfg.task.train_seed)
    return [t for t in batch for _ in range(cfg.num_generations)], resolve_tools(cfg.rollout.tools)


@dataclass
class IterationWork:
    """What one ``selfrl run`` iteration works on, built from a benchmark's run config.

    Attributes:
        cfg: the :class:`selfrl.config.RunConfig`.
        model: the policy (base model with its LoRA adapter).
        tokenizer: its tokenizer.
        tasks: the first batch's tasks, each ``cfg.num_generations`` times in a row.
        tools: the rollout's tools.
        groups: one group id per task (``"g0"``, ``"g0"``, ..., ``"g1"``, ...).
        learner: a :class:`selfrl.rl.learner.Learner` on ``model`` with the config's update settings.
    """

    cfg: Any
    model: Any
    tokenizer: Any
    tasks: list
    tools: list
    groups: list[str]
    learner: Any


def iteration_work(args: argparse.Namespace, config: Path, prefix: str) -> IterationWork:
    """The policy, first batch and learner of ``selfrl run`` on the config at ``config``
    (:func:`bench_config`: a tiny model in a temporary folder named ``prefix...`` with ``--tiny``)."""
    from selfrl.rl.learner import Learner
    from selfrl.model.load import build_policy

    cfg = bench_config(args, config, prefix)
    model, tok = build_policy(cfg)
    tasks, tools = first_batch(cfg)
    groups = [f"g{i // cfg.num_generations}" for i in range(len(tasks))]
    learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id, cfg.max_completion_length)
    return IterationWork(cfg, model, tok, tasks, tools, groups, learner)


def give_signal(trajs: list) -> None:
    """Set every trajectory's reward (0, 1, 0, ...) and a non-zero advantage (-1, +1, -1, ...),
    so that an update trains on all of them (a benchmark times the whole batch)."""
    for i, t in enumerate(trajs):
        t.reward, t.advantage = float(i % 2), 1.0 if i % 2 else -1.0


def run_clients(client: Callable[[int], None], clients: int) -> float:
    """Run ``client(0)`` ... ``client(clients - 1)`` at once, each in its own thread; returns the
    wall seconds from the first start to the last end."""
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def run_child(argv: list[str], result_file: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run ``python argv...`` in its own process (own peak RSS, no shared thread pools) and
    return the JSON it wrote to ``result_file``. The child imports ``selfrl`` from this checkout
    (``ROOT`` first on its ``PYTHONPATH``), as the parent does, whether or not an install of it
    is on the interpreter's path.

    Raises:
        RuntimeError: the child failed; its stderr tail is in the message.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0 or not Path(result_file).exists():
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(Path(result_file).read_text())


def in_memory_dataset(rows: list[dict[str, Any]], fingerprint: str):
    """A ``datasets.Dataset`` of ``rows`` (for TRL's trainers) with the given fingerprint.

    ``Dataset.from_list`` hashes the Arrow table for a fingerprint, and that fails with
    datasets 5.1-5.2, dill 0.4.1 and pyarrow 25-26 ("Can't pickle <class 'MonthDayNano'>");
    nothing here is cached, so a fixed fingerprint loses nothing."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=fingerprint)


def serve_app(app: Any, what: str, timeout_s: float = 60.0) -> tuple[str, Any, threading.Thread]:
    """Run the ASGI ``app`` with uvicorn on a free loopback port, in a daemon thread.

    Returns:
        ``(url, server, thread)``: ``http://127.0.0.1:PORT``, the ``uvicorn.Server`` (set
        ``should_exit`` to stop it) and its thread.

    Raises:
        RuntimeError: ``what`` (e.g. "the slots server") did not start within ``timeout_s`` seconds.
    """
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread
