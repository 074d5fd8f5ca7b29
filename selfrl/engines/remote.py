"""A sampling backend in another process: ``selfrl sampler`` reached over HTTP.

:class:`RemoteEngine` provides the engine interface (:mod:`selfrl.engines.base`) by
forwarding each call to a ``selfrl sampler`` server (:mod:`selfrl.serve.sampler_app`).
The token ids and logprobs are the server engine's, exactly; the tokenizer stays
local (the rollout renders prompts and decodes turns with it) and must be the
server model's.

Departures from the in-process engine: ``on_step`` is called once, with the whole
result, after the server answers (the server does not stream); a swap sends the
LoRA tensors as safetensors bytes, or, for a saved version folder, only its path
(the server reads it from its own file system and verifies its checksums).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from selfrl.engines import http
from selfrl.engines.base import AdapterSource, EngineHealth, Generation, check_generate_args


class RemoteEngine:
    """The engine interface over a ``selfrl sampler`` at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8100``.
        tokenizer: the served model's tokenizer.
        api_key: the sampler's API key, if it has one.
        timeout_s: seconds one call may take (generation included).

    Raises:
        selfrl.engines.http.RemoteBackendError: the sampler cannot be reached.
    """

    name = "http"

    def __init__(self, base_url: str, tokenizer, api_key: str | None = None, timeout_s: float = 600.0):
        self.base_url, self.tokenizer, self.api_key, self.timeout_s = base_url.rstrip("/"), tokenizer, api_key, timeout_s
        info = self._call("/sampler/info")
        self.eos_token_ids: list[int] = sorted(info["eos_token_ids"])
        self.version: int = int(info["version"])
        # tokens the served model attends to (prompt + completion); None from an older sampler
        self.context: int | None = info.get("context")

    def _call(self, path: str, body=None, timeout_s: float | None = None, raw: bytes | None = None):
        return http.call(self.base_url, path, body, timeout_s=timeout_s or self.timeout_s, api_key=self.api_key,
                         raw=raw)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                 top_p: float = 1.0, on_step: Callable | None = None, stop: list[str] | None = None) -> list[Generation]:
        """See :meth:`selfrl.engines.base.SamplingEngine.generate`; ``on_step`` is called once, at the end.

        Raises:
            ValueError: arguments every backend refuses, or the server's refusal.
            selfrl.engines.http.RemoteBackendError, TimeoutError: the server failed or did not answer.
        """
        check_generate_args(prompts, max_new_tokens, temperature, greedy, top_p)
        out = self._call("/sampler/generate", {"prompts": prompts, "max_new_tokens": max_new_tokens,
                                               "temperature": temperature, "greedy": greedy, "top_p": top_p,
                                               "stop": stop})
        gens = [Generation(g["token_ids"], g["logprobs"], g["finished"], g["adapter_version"], g["stopped"])
                for g in out["generations"]]
        if gens:
            self.version = gens[0].adapter_version
        if on_step is not None and gens:
            import torch

            width = max(len(g.token_ids) for g in gens)
            pad = self.eos_token_ids[0]
            on_step(torch.tensor([g.token_ids + [pad] * (width - len(g.token_ids)) for g in gens]))  # (B, n)
        return gens

    def swap(self, adapter: AdapterSource, version: int) -> float:
        """Load ``adapter`` into the server as ``version``; returns the seconds the whole call took.

        Raises:
            ValueError: the server refused the adapter (it does not fit; nothing changed there).
        """
        t = time.perf_counter()
        if isinstance(adapter, (str, Path)):
            out = self._call(f"/sampler/adapters/{int(version)}/load", {"path": str(Path(adapter).resolve())})
        else:
            from safetensors.torch import save

            tensors = {k: v.detach().cpu().contiguous() for k, v in adapter.items()}
            out = self._call(f"/sampler/adapters/{int(version)}", raw=save(tensors))
        self.version = int(out["version"])
        return time.perf_counter() - t

    def health(self) -> EngineHealth:
        """The server's own health; ``ok = False`` with the reason when it cannot be reached."""
        try:
            h = self._call("/sampler/health", timeout_s=min(self.timeout_s, 10.0))
        except (http.RemoteBackendError, TimeoutError) as e:
            return EngineHealth(False, self.version, self.name, str(e))
        return EngineHealth(bool(h["ok"]), int(h["version"]), self.name, f"remote {h['backend']}: {h['detail']}")

    def prompt_logprobs(self, token_ids: list[int], timeout_s: float | None = None) -> tuple[list[float], int]:
        """(n - 1) temperature-1 log-probs of ``token_ids[1:]`` on the server, and its version (swap check)."""
        out = self._call("/sampler/logprobs", {"token_ids": token_ids, "temperature": 1.0}, timeout_s=timeout_s)
        return out["logprobs"], int(out["version"])
