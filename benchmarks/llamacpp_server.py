"""llama.cpp's ``llama-server`` driven from Python for the comparison in
``benchmarks/bench_llamacpp.py``: start it on a free loopback port, ask for token ids and
their log-probs (``/completion``), and send a batch of such requests at once."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

# llama.cpp's samplers that truncate the distribution, turned off: the draw is from softmax(logits / T).
FULL_DISTRIBUTION = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "samplers": ["temperature"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, timeout_s: float = 600.0) -> tuple[int, object]:
    """(HTTP status, decoded JSON or text) of a JSON POST; 4xx/5xx are returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class LlamaServer:
    """``llama-server`` on a free loopback port for the ``with`` block; its log goes to ``log``.

    Raises:
        RuntimeError: it exited or did not answer ``/health`` within ``start_timeout_s``.
    """

    def __init__(self, binary: str, gguf: Path, threads: int, parallel: int, extra: list[str], log: Path,
                 start_timeout_s: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                     "-tb", str(threads), "--parallel", str(parallel), "--cont-batching", "-c", str(512 * parallel),
                     "--no-webui", *extra]
        self.log, self.start_timeout_s = log, start_timeout_s

    def __enter__(self) -> "LlamaServer":
        t = time.perf_counter()
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t > self.start_timeout_s:
                self.__exit__()
                raise RuntimeError(f"llama-server did not answer /health within {self.start_timeout_s:g} s")
            time.sleep(0.1)
        self.start_s = time.perf_counter() - t
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def parse_completion(body: dict) -> tuple[list[int], list[float] | None, str]:
    """(sampled ids, their log-probs or None, stop type) of a llama-server ``/completion``
    answer made with ``n_probs > 0`` and ``return_tokens``.

    The log-probs are None when ``completion_probabilities`` does not line up with
    ``tokens``: measured here, llama-server leaves out the entries of some tokens (those
    that end inside a multi-byte UTF-8 character, it seems), so the ids and log-probs of
    such a row cannot be paired, and an RL learner cannot use the row.

    Raises:
        ValueError: the answer has no per-token log-probs at all.

    >>> parse_completion({"tokens": [5, 7], "stop_type": "limit",
    ...                   "completion_probabilities": [{"id": 5, "logprob": -0.5}, {"id": 7, "logprob": -1.0}]})
    ([5, 7], [-0.5, -1.0], 'limit')
    """
    probs = body.get("completion_probabilities")
    if probs is None:
        raise ValueError("no completion_probabilities in the answer (was n_probs > 0?)")
    ids = [int(p["id"]) for p in probs]
    tokens = [int(t) for t in body.get("tokens") or ids]
    logps = [float(p["logprob"]) for p in probs] if tokens == ids else None
    return tokens, logps, str(body.get("stop_type", ""))


def llama_generate(url: str, prompt: list[int], max_new_tokens: int, temperature: float, seed: int,
                   cache_prompt: bool = True) -> dict:
    """One ``/completion`` from token ids, full distribution, with the sampled ids and log-probs
    (``cache_prompt``: reuse a slot's KV cache of an earlier prompt with the same prefix).

    Raises:
        RuntimeError: the server refused or failed.
    """
    status, body = post(url + "/completion", {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature,
                                              "seed": seed, "n_probs": 1, "return_tokens": True, "cache_prompt": cache_prompt,
                                              **FULL_DISTRIBUTION})
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"llama-server /completion: HTTP {status}: {str(body)[:300]}")
    ids, logps, stop = parse_completion(body)
    return {"token_ids": ids, "logprobs": logps, "stop_type": stop, "settings": body.get("generation_settings", {})}


def llama_batch(url: str, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                cache_prompt: bool = True) -> list[dict]:
    """All ``prompts`` as concurrent ``/completion`` requests (one thread each); results in order.

    Raises:
        RuntimeError: any request failed.
    """
    out: list[dict | BaseException] = [RuntimeError("not run")] * len(prompts)

    def one(i: int) -> None:
        try:
            out[i] = llama_generate(url, prompts[i], max_new_tokens, temperature, seed + i, cache_prompt)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for o in out:
        if isinstance(o, BaseException):
            raise RuntimeError(f"a llama-server request failed: {o}") from o
    return out  # type: ignore[return-value]
