"""The engine interface: what everything that samples (the run loop, the gate, the
server, the benchmarks) may ask of a sampling backend.

A backend is any object with the attributes and methods of :class:`SamplingEngine`
(a ``typing.Protocol``: no base class to inherit). It must:

- ``generate``: sample one continuation per prompt and return the *exact* token ids
  it sampled with the log-probability of each under ``logits / temperature`` over
  the whole vocabulary (the quantity the learner recomputes for the importance
  ratio), honouring ``stop`` strings and the token limit;
- ``swap``: load an adapter version (a LoRA state dict, or the folder of a saved
  version) and tag every later generation with that version;
- ``version``: the version being served;
- ``health``: say whether it can serve, without sampling.

``tests/test_engine_conformance.py`` is the contract: every backend is added to its
parameter list (``tests/engine_backends.py``) and must pass all of it. The in-process
reference backend is :class:`selfrl.engines.reference.Engine`.
"""

from __future__ import annotations

import numbers

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        token_ids: (n,) the sampled ids, the EOS included when one was sampled.
        logprobs: (n,) log-probability of each sampled id under ``logits / temperature``
            (greedy decoding records the temperature-1 logprob).
        finished: True when the turn ended within the token limit: an EOS was sampled,
            or a stop string was completed (then ``stopped`` is True too).
        adapter_version: version of the weights that produced the tokens.
        stopped: True when a stop string ended the turn; no EOS was sampled, the last
            id is the one that completed the stop string.
        constrained: (n,) per id, True where a grammar removed ids from its distribution
            (its logprob is then the masked distribution's); None when the row had no
            constraint (see :mod:`selfrl.chat.constrain`).
        grammar_error: why the row's grammar failed mid-generation (a schema with no
            finite value that no preflight caught, say); the row ended there, ``finished`` is
            False and ``token_ids`` end before the failure's end of turn. None otherwise.
        top_logprobs: (n, k) the k most likely ids at each position and their logprobs
            (same distribution as ``logprobs``), most likely first; None unless asked for
            (``generate(top_logprobs=k)``, a backend that supports it).
    """

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    adapter_version: int
    stopped: bool = False
    constrained: list[bool] | None = None
    cancelled: bool = False  # the caller cancelled the row mid-generation (then ``finished`` is False)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    grammar_error: str | None = None

    @property
    def finish_reason(self) -> FinishReason:
        """OpenAI's vocabulary: ``"stop"`` (EOS or a stop string), ``"length"`` (token limit).

        >>> Generation([5, 2], [-1.0, -0.5], True, 0).finish_reason
        'stop'
        """
        return "stop" if self.finished else "length"


@dataclass
class EngineHealth:
    """What :meth:`SamplingEngine.health` reports.

    Attributes:
        ok: the backend can take requests now.
        version: the adapter version it serves.
        backend: its registered name (``"reference"``, ``"slots"``, ...).
        detail: why it is not ok, or a short note (slots in use, queue length).
    """

    ok: bool
    version: int
    backend: str
    detail: str = ""


AdapterSource = Mapping[str, "object"] | str | Path  # a LoRA state dict, or a saved version's folder


@runtime_checkable
class SamplingEngine(Protocol):
    """The interface every sampling backend provides (see the module docstring).

    Attributes:
        tokenizer: the policy's tokenizer (the rollout renders prompts with it and
            decodes turns for stop strings and tool calls).
        eos_token_ids: sorted ids that end an assistant turn.
        version: the adapter version now served; every :class:`Generation` returned
            later carries the version it was sampled with.
    """

    tokenizer: object
    eos_token_ids: list[int]
    version: int
    # A backend that honours ``generate(..., constraints=[...])`` (one
    # selfrl.chat.constrain.Constraint or None per prompt) sets ``supports_constraints = True``;
    # the server refuses constrained requests on a backend without it, never ignoring them.
    # A backend that honours ``generate(..., cancel=[threading.Event, ...])`` (a row stops
    # at the next step once its event is set; its Generation has ``cancelled=True``) sets
    # ``supports_cancel = True``; without it a cancelled row runs to its end.

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        greedy: bool = False,
        top_p: float = 1.0,
        on_step: Callable | None = None,
        stop: list[str] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt; all of them on one adapter version.

        Args:
            prompts: B lists of token ids (any lengths, none empty).
            max_new_tokens: token limit per continuation (>= 1).
            temperature: sampling temperature (> 0); ignored when ``greedy``.
            greedy: argmax decoding; the temperature-1 logprob is recorded.
            top_p: nucleus sampling (1.0 = off); the recorded logprobs stay those of the
                full distribution ``log_softmax(logits / temperature)``.
            on_step: optional streaming hook, called with a (B, k) tensor of the ids
                sampled so far (rows that ended may hold anything after their end).
            stop: strings that end a turn: a row is cut right after the token that
                completes one (``stopped`` and ``finished`` set, no EOS appended).

        Optional keywords a backend may accept (the reference engine does; the server asks
        with ``Batcher.supports`` and refuses ``top_logprobs`` where it is missing):
        ``top_logprobs=k`` fills :attr:`Generation.top_logprobs`; ``step_logprobs=True``
        calls ``on_step(ids, logprobs, top)`` so that a stream carries its logprobs.

        Returns:
            B :class:`Generation`, in prompt order.

        Raises:
            ValueError: no prompts, an empty prompt, ``max_new_tokens < 1``,
                ``temperature <= 0`` when sampling, or ``top_p`` outside (0, 1].
        """
        ...

    def swap(self, adapter: AdapterSource, version: int) -> float:
        """Serve ``adapter`` as ``version`` from the next generation on; returns seconds taken.

        Raises:
            ValueError: the adapter does not fit the model (nothing changes then).
        """
        ...

    def health(self) -> EngineHealth:
        """Whether the backend can serve now, and which version; never samples."""
        ...


# The lowest sampling temperature: logits / t must stay finite in fp32 (|logits| of a few hundred at
# most), and below it sampling is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-4
# The highest: at 100 the logits (a few tens apart at most) differ by well under one unit, so the
# distribution is uniform in all but name; beyond it a temperature is a mistake (1e308 was accepted).
MAX_TEMPERATURE = 100.0


def check_generate_args(prompts: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool,
                        top_p: float, vocab_size: int | None = None) -> None:
    """Raise ValueError for arguments every backend refuses (see :meth:`SamplingEngine.generate`).

    ``vocab_size`` (rows of the model's input embedding), when given: every prompt id must
    be an integer in ``[0, vocab_size)``. A backend that knows its model checks this in the
    caller's thread, so a bad id is a clear error there and never a failure inside a batch
    that other requests share.

    >>> check_generate_args([[1, 2, 70]], 4, 1.0, False, 1.0, vocab_size=64)
    Traceback (most recent call last):
    ...
    ValueError: prompt 0 holds token id 70 at position 2; ids must be integers in [0, 64)
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no prompt may be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not temperature >= MIN_TEMPERATURE:
        raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} for sampling (below it the logits divided by it "
                         f"overflow fp32; greedy decoding gives the most likely id), got {temperature}")
    if not greedy and not temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g} for sampling (above it the distribution is "
                         f"uniform in all but name), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if vocab_size is not None:
        check_token_ids(prompts, vocab_size)


def model_context(model, tokenizer) -> int:
    """Tokens ``model`` attends to, prompt and completion together: its config's
    ``max_position_embeddings``, else the tokenizer's ``model_max_length``."""
    return int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)


def engine_context(engine) -> int | None:
    """Tokens ``engine`` can attend to (prompt and completion), or None when it does not say:
    its ``context`` attribute (a remote sampler reports it in ``/sampler/info``), else its local
    ``model``'s :func:`model_context`."""
    context = getattr(engine, "context", None)
    if context is not None:
        return int(context)
    model = getattr(engine, "model", None)
    return None if model is None else model_context(model, engine.tokenizer)


def context_overflow(prompt_len: int, max_new_tokens: int | None, context: int, prompt_field: str,
                     limit_field: str) -> tuple[str, str] | None:
    """Why a prompt of ``prompt_len`` tokens and a token limit of ``max_new_tokens`` (None:
    the server picks one that fits) do not fit in a context of ``context`` tokens, as
    ``(message, field)`` (``prompt_field`` or ``limit_field``); None when they fit. Both
    servers refuse such a request with a 400 naming the field; neither clamps it.

    >>> context_overflow(10, 10**9, 1024, "messages", "max_tokens")
    ('max_tokens 1000000000 + prompt 10 tokens exceeds the context of 1024 tokens', 'max_tokens')
    >>> context_overflow(10, 1014, 1024, "messages", "max_tokens") is None
    True
    """
    if prompt_len >= context:
        return f"the prompt is {prompt_len} tokens; this model's context is {context} tokens", prompt_field
    if max_new_tokens is not None and prompt_len + max_new_tokens > context:
        return (f"{limit_field} {max_new_tokens} + prompt {prompt_len} tokens exceeds the context of {context} "
                "tokens", limit_field)
    return None


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    """Raise ValueError unless every id of every prompt is an integer in ``[0, vocab_size)``
    (``vocab_size``: rows of the model's input embedding).

    >>> check_token_ids([[0, 63], [True]], 64)
    Traceback (most recent call last):
    ...
    ValueError: prompt 1 holds token id True at position 0; ids must be integers in [0, 64)
    """
    for i, p in enumerate(prompts):
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i} holds token id {t!r} at position {j}; ids must be integers in "
                                 f"[0, {vocab_size})")


def adapter_state(adapter: AdapterSource) -> dict:
    """A LoRA state dict from ``adapter``: returned as is when it is one, loaded (and
    checksum-verified, :func:`selfrl.record.adapters.load_version_state`) when it is a folder."""
    if isinstance(adapter, (str, Path)):
        from selfrl.record.adapters import load_version_state

        return load_version_state(Path(adapter))
    return dict(adapter)
