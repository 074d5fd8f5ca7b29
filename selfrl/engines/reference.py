"""The inference engine: batched sampling that returns exact token ids and logprobs,
and in-place hot-swap of LoRA adapter versions.

The engine wraps a peft model whose LoRA weights are the *current adapter
version*. Swapping a version copies the LoRA tensors straight into the LoRA
parameters (``Engine.swap``; ``peft.set_peft_model_state_dict`` only for adapters
that cannot be mapped that way): the base model is never reloaded, and the swap of a
rank-16 adapter takes a few milliseconds on the CPU.

Sampling uses Hugging Face ``generate`` with every logits warper off except the
temperature (``top_k=0``, ``top_p=1``), so the logprob recorded for a sampled
token is exactly ``log_softmax(logits / temperature)[token]`` — the quantity the
learner recomputes for the importance ratio.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from selfrl.engines.base import AdapterSource, EngineHealth, Generation, adapter_state, check_generate_args
from selfrl.engines.sharedattention import model_window
from selfrl.model.prefix import shared_prefix_len

__all__ = ["Engine", "Generation", "eos_ids", "pack_prompts", "stop_cut", "check_adapter_state"]


def eos_ids(model, tokenizer) -> list[int]:
    """All ids that end an assistant turn: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; the engine cannot tell when a turn ends")
    return sorted(ids)


def pack_prompts(prompts: list[list[int]], shared: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay prompts out as ``[shared prefix][padding][own suffix]`` per row.

    With ``shared == 0`` this is plain left padding. The padding sits between the
    prefix and the suffix so the prefix occupies the same columns in every row and
    its cache can be computed once; position ids come from the attention mask, so
    every real token keeps the position it has in an unpadded sequence.

    Returns:
        ``input_ids`` (B, P) and ``attention_mask`` (B, P).
    """
    width = shared + max(len(p) - shared for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros_like(input_ids)  # (B, P)
    for i, p in enumerate(prompts):
        input_ids[i, :shared] = torch.tensor(p[:shared], dtype=torch.long)
        attention_mask[i, :shared] = 1
        own = p[shared:]
        input_ids[i, width - len(own):] = torch.tensor(own, dtype=torch.long)
        attention_mask[i, width - len(own):] = 1
    return input_ids, attention_mask


class Engine:
    """Batched generation over a (peft) causal LM, tagged with an adapter version: the
    reference backend of :class:`selfrl.engines.base.SamplingEngine` (one ``generate``
    call is one batch from start to end; nothing joins it while it runs).

    Args:
        model: the policy, usually a ``peft.PeftModel``; shared with the learner in
            ``selfrl run`` (one copy of the weights in memory).
        tokenizer: its tokenizer; ``pad_token_id`` must be set.
        version: the adapter version currently in the weights.
        share_prefix: encode the prompts' common prefix once per batch (see :func:`pack_prompts`);
            not for a model with a sliding window, which would count the padding between the
            prefix and each row's own ids.

    Thread safety: ``generate`` and ``swap`` take the same lock, so a generation
    always runs on exactly one version from start to end.
    """

    name = "reference"
    supports_constraints = True  # honours generate(..., constraints=...) (selfrl.chat.constrain)
    supports_cancel = True  # honours generate(..., cancel=...): a cancelled row stops at the next step

    def __init__(self, model, tokenizer, version: int = 0, share_prefix: bool = True):
        self.model = model
        # a sliding window counts the padding packing puts between a shared prefix and a row's own ids
        self.share_prefix = share_prefix and model_window(model) is None
        self.tokenizer = tokenizer
        self.version = version
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id
        self.num_embeddings = model.get_input_embeddings().weight.shape[0]  # prompt ids are < this
        self.lock = threading.RLock()
        self._lora_params: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        greedy: bool = False,
        top_p: float = 1.0,
        on_step: Callable[..., None] | None = None,
        stop: list[str] | None = None,
        top_logprobs: int = 0,
        step_logprobs: bool = False,
        constraints: list | None = None,
        cancel: list[threading.Event] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt.

        Args:
            prompts: B lists of token ids (any lengths; left-padded internally).
            max_new_tokens: token limit per continuation.
            temperature: sampling temperature (> 0); ignored when ``greedy``.
            greedy: argmax decoding (validation).
            top_p: nucleus sampling (serving only; 1.0 = off). With ``top_p < 1`` the
                recorded ``logprobs`` are still those of ``logits / temperature`` over the
                whole vocabulary (what the learner recomputes), not of the truncated
                distribution the token was drawn from.
            on_step: called during decoding with the (B, n) ids sampled so far (rows
                that ended keep receiving pad ids); used to stream tokens. The last
                token of each row is only in the returned :class:`Generation`.
            stop: strings that end a turn (e.g. ``"</tool_call>"``): a row is cut right
                after the token that completes one, before any EOS. The ids after it
                are dropped, which leaves the kept ones exactly as sampled (decoding is
                left to right); the batch still decodes up to its limit.
            top_logprobs: also return the k most likely ids per position (0 = none).
            step_logprobs: call ``on_step(ids, logprobs, top)`` instead: ``logprobs`` (B, n)
                of the ids so far (the same values the result records) and ``top`` a pair of
                (B, n, k) tensors (ids, logprobs) of the ``top_logprobs`` most likely ids, or None.
            constraints: B :class:`selfrl.chat.constrain.Constraint` or None (one per row;
                None everywhere = unconstrained). A constrained row samples only ids its
                grammar allows; its recorded logprobs are those of the masked
                distribution and ``Generation.constrained`` flags the steps the mask
                restricted (see :mod:`selfrl.chat.constrain`). A row whose grammar fails
                mid-generation ends there alone, with ``Generation.grammar_error`` set.
            cancel: B events or None: a row whose event is set stops at the next step
                (a client that went away); it returns the ids sampled until then with
                ``cancelled=True``, ``finished=False``. When every row has stopped the
                batch ends.

        Returns:
            B :class:`Generation`, in order.

        Raises:
            ValueError: empty prompt list, an empty prompt, a prompt id that is not an
                integer in ``[0, num_embeddings)``, max_new_tokens < 1, temperature <= 0,
                top_p outside (0, 1], or ``constraints`` not one per prompt.
            selfrl.chat.constrain.ConstraintError: a grammar that does not compile.
        """
        check_generate_args(prompts, max_new_tokens, temperature, greedy, top_p, self.num_embeddings)
        if constraints is not None and len(constraints) != len(prompts):
            raise ValueError(f"constraints must be one per prompt ({len(prompts)}), got {len(constraints)}")
        if constraints is not None and all(c is None for c in constraints):
            constraints = None
        shared = shared_prefix_len(prompts) if self.share_prefix else 0
        input_ids, attention_mask = pack_prompts(prompts, shared, self.pad_token_id)  # (B, P), (B, P)
        device = next(self.model.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        width = input_ids.shape[1]
        # Sampling: temperature only, every other warper off. Greedy: no sampling flags at all.
        sampling = (dict(do_sample=False, top_k=None, top_p=None, temperature=None) if greedy else
                    dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p, min_p=None))
        with self.lock:
            version = self.version
            was_training = self.model.training
            self.model.eval()
            extra = {}
            if shared:
                # The shared prefix (system prompt, demonstration) is encoded once and its
                # key/value cache repeated for every row, instead of once per row.
                cache = self.model(input_ids=input_ids[:1, :shared], use_cache=True).cache
                cache.batch_repeat_interleave(len(prompts))
                extra["cache"] = cache
            processors = []
            masks = None
            if constraints is not None:
                from selfrl.chat.constrain import GrammarMasks

                vocab = self.model.get_output_embeddings().weight.shape[0]
                masks = GrammarMasks(constraints, self.tokenizer, vocab, self.eos_token_ids, width)
                processors.append(masks)
            if on_step is not None:  # after the masks: streamed logprobs are the masked distribution's
                scale_or_none = (1.0 if greedy else temperature) if step_logprobs else None
                processors.append(_StepObserver(width, on_step, scale_or_none, top_logprobs))
            if processors:
                from transformers import LogitsProcessorList

                extra["logits_processor"] = LogitsProcessorList(processors)
            stopper = None
            if cancel is not None:
                from transformers import StoppingCriteriaList

                stopper = _Cancelled(width, cancel)
                extra["stopping_criteria"] = StoppingCriteriaList([stopper])
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                repetition_penalty=1.0,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
                **extra,
                **sampling,
            )
            if was_training:
                self.model.train()
        new = out.sequences[:, width:]  # (B, N)
        scale = 1.0 if greedy else temperature
        logits = torch.stack(out.logits, dim=1).float() / scale  # (B, N, V)
        all_logps = torch.log_softmax(logits, dim=-1)  # (B, N, V)
        logps = all_logps.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, N)
        top = all_logps.topk(min(top_logprobs, all_logps.shape[-1]), dim=-1) if top_logprobs > 0 else None  # (B, N, k)
        eos = torch.tensor(self.eos_token_ids, device=new.device)
        results = []
        for i in range(len(prompts)):
            row = new[i].tolist()
            is_eos = torch.isin(new[i], eos).nonzero()
            n = int(is_eos[0]) + 1 if len(is_eos) else len(row)
            cancelled = stopper is not None and i in stopper.cut and (not len(is_eos) or stopper.cut[i] < n)
            if cancelled:  # after the cut the row holds padding, which may be the EOS id
                n, is_eos = stopper.cut[i], []
            row_logps, flags = logps[i], None
            row_top = None if top is None else (top.indices[i], top.values[i])  # (N, k), (N, k)
            if masks is not None and constraints[i] is not None:  # the masked distribution, sampled from
                row_all, flags = masks.masked_logps(i, logits[i])  # (N, V), N flags
                row_logps = row_all.gather(-1, new[i].unsqueeze(-1)).squeeze(-1)  # (N,)
                if top is not None:
                    masked_top = row_all.topk(top.values.shape[-1], dim=-1)  # (N, k)
                    row_top = (masked_top.indices, masked_top.values)
            cut = stop_cut(self.tokenizer, row[:n], stop) if stop else None
            keep, done = (cut, True) if cut is not None else (n, bool(len(is_eos)))
            error = None if masks is None or cut is not None else masks.errors[i]
            if error is not None:  # the grammar failed: the EOS it was ended with is not the model's
                keep, done = n - 1 if len(is_eos) else n, False
            alts = None
            if row_top is not None:
                alts = [list(zip(ix, lp)) for ix, lp in zip(row_top[0][:keep].tolist(), row_top[1][:keep].tolist())]
            results.append(Generation(row[:keep], row_logps[:keep].tolist(), done, version, stopped=cut is not None,
                                      constrained=None if flags is None else flags[:keep], cancelled=cancelled,
                                      top_logprobs=alts, grammar_error=error))
        return results

    def swap(self, state_dict: AdapterSource, version: int) -> float:
        """Hot-swap the LoRA weights to ``version`` in place; returns the seconds it took.

        ``state_dict`` is peft's LoRA state dict, or the folder of a saved version
        (verified and loaded with :func:`selfrl.record.adapters.load_version_state`).

        The tensors are copied straight into the LoRA parameters (a few milliseconds for
        a rank-16 adapter of a 135M model); models whose adapter cannot be mapped that
        way go through ``peft.set_peft_model_state_dict`` (about 80 ms).

        Raises:
            ValueError: the state dict does not match the model's LoRA parameters
                (nothing is changed in that case).
        """
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        t = time.perf_counter()
        state_dict = adapter_state(state_dict)
        with self.lock:
            params = self.lora_parameters()
            if params:
                check_adapter_state(state_dict, params, version)
                with torch.no_grad():
                    for key, p in params.items():
                        p.copy_(state_dict[key])
            else:
                check_adapter_state(state_dict, get_peft_model_state_dict(self.model), version)
                set_peft_model_state_dict(self.model, state_dict)
            self.version = version
        return time.perf_counter() - t

    def health(self) -> EngineHealth:
        """Always ok in process (the model is in this process's memory); the detail says
        whether a generation or swap holds the engine now."""
        busy = not self.lock.acquire(blocking=False)
        if not busy:
            self.lock.release()
        return EngineHealth(True, self.version, self.name, "busy" if busy else "idle")

    def lora_parameters(self) -> dict[str, torch.Tensor]:
        """The model's LoRA parameters under peft's state-dict keys (computed once), or
        {} when they do not map one to one onto ``get_peft_model_state_dict``'s keys."""
        if self._lora_params is None:
            from peft import get_peft_model_state_dict

            expected = get_peft_model_state_dict(self.model)
            adapter = getattr(self.model, "active_adapter", "default")
            found = {}
            for name, p in self.model.named_parameters():
                key = name.replace(f".{adapter}.", ".")
                if key in expected and p.shape == expected[key].shape:
                    found[key] = p
            self._lora_params = found if found.keys() == expected.keys() else {}
        return self._lora_params


def stop_cut(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The number of leading ``ids`` up to the one that completes the first stop string, or None."""
    if not any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
        return None
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s in text for s in stop):
            return k
    return None


class _StepObserver:
    """A logits processor that changes nothing and reports the ids sampled so far.

    ``generate`` calls it before each new token with the whole sequence, so at
    step k it sees the k ids sampled before (B, k); it returns the scores as they are.
    With ``scale`` set it also reports their logprobs, ``log_softmax(scores / scale)``
    of the scores it saw one step earlier (the raw logits: it runs before any warper),
    and the ``top`` most likely ids with theirs.
    """

    def __init__(self, prompt_width: int, on_step: Callable[..., None], scale: float | None = None, top: int = 0):
        self.width, self.on_step, self.scale, self.top = prompt_width, on_step, scale, top
        self.prev: torch.Tensor | None = None  # (B, V) logprobs of the next token
        self.sampled: list[torch.Tensor] = []  # per step (B,)
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step (B, k) ids, (B, k) logprobs

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = input_ids.shape[1] - self.width
        if self.scale is None:
            if k > 0:
                self.on_step(input_ids[:, self.width:])  # (B, k)
            return scores
        if self.prev is not None and k > 0:
            self.sampled.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))  # (B,)
            if self.top:
                v, ix = self.prev.topk(min(self.top, self.prev.shape[-1]), dim=-1)  # (B, k)
                self.tops.append((ix, v))
        if k > 0 and len(self.sampled) == k:
            top = None
            if self.top:
                top = (torch.stack([t[0] for t in self.tops], 1), torch.stack([t[1] for t in self.tops], 1))
            self.on_step(input_ids[:, self.width:], torch.stack(self.sampled, 1), top)  # (B, k), (B, k)
        self.prev = torch.log_softmax(scores.float() / self.scale, dim=-1)  # (B, V)
        return scores


class _Cancelled:
    """A stopping criterion: row i is done once ``events[i]`` is set. ``cut[i]`` is the
    number of ids row i had sampled then (the ids after it are padding)."""

    def __init__(self, prompt_width: int, events: list[threading.Event | None]):
        self.width, self.events, self.cut = prompt_width, events, {}

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)  # (B,)
        for i, e in enumerate(self.events):
            if e is not None and e.is_set():
                self.cut.setdefault(i, input_ids.shape[1] - self.width)
                done[i] = True
        return done


def check_adapter_state(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], version: int) -> None:
    """Raise ValueError unless ``state_dict`` has exactly the keys and shapes of ``expected``.

    Checked before anything is copied: peft's ``set_peft_model_state_dict`` loads the
    keys that match and only reports the others, which would leave a half-swapped model.
    """
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    reshaped = [
        f"{k} {tuple(state_dict[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    problems = [
        f"{what} {items[:3]}" for what, items in
        (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", reshaped)) if items
    ]
    if problems:
        raise ValueError(f"adapter version {version} does not fit this model: " + "; ".join(problems))
