"""``selfrl serve`` as a subprocess for ``scripts/soak.py``: its config, start, ``kill -9``,
restart and stop; its families (:data:`FAMILIES`, shared with the simulated users); the admin
calls; the server's RSS and the run directory's size."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key-0123456789abcdef"
# The server's config. The learner validates every second candidate (gate.eval_every = 2: it trains
# on from the first unvalidated, unserved), so a gate's cost is paid once per two updates; the served
# turns are then up to one weight change behind at the chain's second update, within the age rule
# (learner.max_feedback_age_versions = 4, at least eval_every - 1, or serve refuses the config).
SERVE_TOML = """\
run_dir = "{run_dir}"
port = {port}
max_tokens_default = {tokens}
batch_window_s = 0.05
[model]
name = "{model}"
[lora]
r = {lora_r}
[gate]
batch_size = {gate_batch}
eval_every = 2
[rollout]
max_new_tokens = {tokens}
max_turns = 2
[learner]
min_batch = {min_batch}
max_batch = {max_batch}
poll_s = 0.5
feedback_wait_s = {feedback_wait_s}
max_feedback_age_versions = 4
learn_from_corrections = "calls"
retry_s = 0.5
retry_max_s = 5.0
[collapse]
max_kl = {max_kl}
window_s = 1800.0
stable_s = 600.0
cooldown_s = 120.0
[retention]
keep_newest = {keep_newest}
keep_promoted = {keep_promoted}
delete = {delete}
[train]
learning_rate = {lr}
micro_batch_tokens = {micro_batch_tokens}
gradient_checkpointing = {checkpointing}
{families}"""


@dataclass(frozen=True)
class SoakFamily:
    """One family of the soak, for both ends: the server's ``[[families]]`` table (its held-out
    set, tolerance and decoding) and the simulated users' ``FamilySettings`` (their options,
    ``tool_choice`` and budget). The users' ``heldout_size``/``heldout_seed`` are this family's
    ``val_size``/``val_seed``, so no user ever asks one of the server's held-out tasks."""

    name: str
    source: str
    options: dict[str, Any]
    tool_choice: str  # what the users send: auto | required
    max_turns: int  # completions of one users' conversation (the server's held-out rollouts take [rollout] max_turns)
    max_tokens: int | None  # max_tokens of each completion (None: the soak's default)
    constrain: str | None  # the server's per-family decoding of its held-out rollouts (None: the server's default)
    val_size: int = 12  # the family's held-out tasks (the server's val_size; soak.py --val-size sets every family's)
    val_seed: int = 2000  # the family's held-out seed (the server's task.val_seed)


# Each mirrors the shipped config of `selfrl run` where a client of `selfrl serve` can follow it:
# configs/function_calling.toml (simple, at most 3 parameters; one turn: the call is the answer;
# 64 tokens; every turn under the tool-call grammar, which serve gives tool_choice = "required")
# and configs/web_easy.toml (easy tier, 2 worked episodes shown, page_ids: the users send each
# turn the tools narrowed to the page shown, so the server's grammar offers only its ids; 3 turns
# of 40 tokens). Arithmetic as before: the calculator offered, tool_choice auto.
# Function calling holds out 96 tasks: `selfrl run` gains about 10 points on it, which 12 tasks
# cannot tell from noise, and 48 only at the edge (a 90-minute soak's 12/48 -> 18/48 had a paired
# 95 % CI of [-0.01, +0.26]); its held-out rollouts are one turn of 64 tokens, the cheapest of the
# three. The 96 hold the earlier soaks' 48 (the same seed) and 48 more no soak had shown.
# The learner's learning rate on the embedded model: configs/function_calling.toml's (the
# soak's slowest family to learn; 1e-4 left its 48 held-out answers unchanged in 90 minutes).
LEARNING_RATE = 2e-4
# A function-calling user's correction carries the right calls: the learner trains on those as
# demonstrations (learner.learn_from_corrections = "calls"). Without them, a 90-minute run at 2e-4 left
# function calling at its base (12/48 -> 11/48): its users rated 32 of its 352 trained turns right, too
# few for one baseline per family to learn from. Not "all": arithmetic's corrections give the final
# number alone, which trained on the turn's prompt rewards answering without the calculator.
# The collapse rule's cap on the candidate's KL to the reference (whole vocabulary, on the batch's
# turns): at 2e-4 a chain of two ordinary updates probed 0.52 and was rolled back under a cap of 0.5
# (at 1e-4 ordinary candidates probed up to 0.42); the injected noise probes about 10.
MAX_KL = 1.0

FAMILIES = (
    SoakFamily("arithmetic", "chain_sum", {}, "auto", max_turns=3, max_tokens=None, constrain=None),
    SoakFamily("function_calling", "function_calling", {"categories": ["simple"], "max_params": 3}, "required",
               max_turns=1, max_tokens=64, constrain="tool_call", val_size=96),
    SoakFamily("web", "web", {"tier": "easy", "page_ids": True, "shots": 2}, "required",
               max_turns=3, max_tokens=40, constrain="tool_call"),
)
def rollout_table(f: "SoakFamily") -> dict[str, Any]:
    """The family's own ``rollout = {...}`` in the server's ``[[families]]``: its users' turn limit,
    and for a family its users decode under ``tool_choice = "required"``: the tool-call grammar,
    a turn that ends at its call, no shared tools (the environment's own), and the environment's
    system prompt, as the users send it (:class:`selfrl.simulate.families.Family`)."""
    table: dict[str, Any] = {"max_turns": f.max_turns}
    if f.constrain is not None:
        from selfrl.envs.registry import build_env

        defaults = getattr(build_env(f.source, f.options, f.name), "config_defaults", {}) or {}
        table.update(constrain=f.constrain, stop_at_tool_call=True, tools=[])
        if "rollout.system_prompt" in defaults:
            table["system_prompt"] = defaults["rollout.system_prompt"]
    return table


def val_size_of(f: SoakFamily, val_size: int | None) -> int:
    """The family's held-out tasks: ``val_size`` when given (every family the same), else its own."""
    return f.val_size if val_size is None else val_size


def families_toml(val_size: int | None, tolerance: float) -> str:
    """The server's ``[[families]]`` tables for :data:`FAMILIES`: each family's source, options,
    held-out set (:func:`val_size_of` tasks from its ``val_seed``), ``tolerance`` (the largest
    held-out drop its no-forgetting gate accepts) and its decoding (:func:`rollout_table`)."""
    out = []
    for f in FAMILIES:
        out.append("\n".join(["", "[[families]]", f"name = {json.dumps(f.name)}", f"source = {json.dumps(f.source)}",
                              f"options = {_inline(f.options)}", f"val_size = {val_size_of(f, val_size)}",
                              f"val_seed = {f.val_seed}",
                              f"tolerance = {tolerance}", f"rollout = {_inline(rollout_table(f))}"]))
    return "\n".join(out) + "\n"


def _inline(options: dict[str, Any]) -> str:
    """``options`` as a TOML inline table (strings, booleans, numbers and lists of them)."""
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + " }" if options else "{}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, path: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """GET (or POST ``body``) ``url + path`` under the API key; ``(status, JSON)``, status 0 when unreachable."""
    import httpx

    try:
        r = httpx.request("GET" if body is None else "POST", url + path, json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {KEY}"})
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


class Server:
    """``selfrl serve`` as a subprocess on one run directory: start, kill -9, restart, stop
    (``extra``: more arguments of ``selfrl serve``, e.g. ``--no-learn``)."""

    def __init__(self, out: Path, config: Path, fault_file: Path, extra: list[str] | None = None):
        self.out, self.config, self.fault_file, self.extra = out, config, fault_file, list(extra or [])
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, port: int, timeout: float = 600.0) -> None:
        """Start it and wait for ``/health`` to answer.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` (its log's tail in the message).
        """
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "SELFRL_FAULT_FILE": str(self.fault_file),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        env.pop("SELFRL_FAULT", None)
        env.pop("SELFRL_API_KEY", None)
        self.starts += 1
        log = open(self.out / f"server-{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(self.config),
                                      "--api-key-file", str(self.out / "key"), *self.extra], env=env, stdout=log, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if call(self.url, "/health", timeout=5)[0] in (200, 503):
                return
            time.sleep(0.5)
        tail = (self.out / f"server-{self.starts}.log").read_text()[-2000:]
        raise RuntimeError(f"selfrl serve did not start (exit {self.proc.poll()}):\n{tail}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def disk_mb(folder: Path) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / 2**20
