"""Constrained decoding: a grammar masks the logits, so that a turn is a tool call or a
(schema-valid) JSON answer by construction, whatever the weights.

What is constrained (``selfrl serve``; OpenAI's request fields):

* ``tool_choice: "required"``: the turn is exactly one
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` naming one of the
  request's tools, its arguments valid against that tool's JSON schema, then EOS.
* ``tool_choice: {"type": "function", "function": {"name": N}}``: the same, for N only.
* ``response_format: {"type": "json_object"}``: one JSON object, then EOS.
* ``response_format: {"type": "json_schema", "json_schema": {"schema": S}}``: one JSON
  value valid against S (``strict`` or not: selfrl always enforces the schema).
* ``response_format`` JSON with tools offered and ``tool_choice`` "auto": either one
  tool call or the JSON answer (what the Agents SDK sends with ``output_type``).

JSON is compact (no whitespace between tokens; ``whitespace_flexible: false``), so a
model cannot spend its token budget on blank space inside a constrained answer. An
object schema that lists ``properties`` and says nothing of ``additionalProperties`` is
closed (as OpenAI's strict mode requires): JSON Schema would allow any extra key, and a
model that invents argument names breaks the tool that receives them (smolagents
refuses the call). Say ``"additionalProperties": true`` to keep an object open.

The grammar library is llguidance (the Rust core of Microsoft's guidance, also used by
vLLM, SGLang and llama.cpp). Chosen over xgrammar 0.2.8 (its wheel pulls triton, a GPU
package, into a CPU install) and lm-format-enforcer 0.11.3 (pure Python, far slower per
token); ``benchmarks/bench_constrain.py`` measures the cost per token.

What the learner does with constrained tokens: a token is *constrained* when the mask
removed at least one token from its distribution, so it was sampled from the masked
distribution ``softmax(masked logits / T)``, not from the policy ``softmax(logits / T)``.
The engine records the masked distribution's logprob for it (the behaviour policy,
exactly) and flags it in ``Generation.constrained``. Two rules use that:

* ``selfrl run`` with ``rollout.constrain = "tool_call"``: the trajectory records each
  constrained turn's span and grammar (``Trajectory.constraints``), and the learner
  replays the grammar on the sampled ids (:func:`replay_masks`; the matcher is
  deterministic) so the policy's, the old and the reference log-probabilities of those
  tokens are all taken over the allowed ids. The ratio is exactly 1 for an unchanged
  policy, and RL learns which of the allowed tokens to write (the argument values), not
  the syntax the grammar already guarantees.
* ``selfrl serve``: constrained tokens are recorded with ``completion_mask = 0`` and
  never enter the loss, the KL or the importance ratio; tokens where the mask removed
  nothing keep ``completion_mask = 1``. A turn decoded entirely under a grammar (every
  JSON token is) has no trained token and stays out of its group (``no_tokens``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from selfrl.chat.toolcall import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

ConstraintKind = Literal["tool_call", "json", "tool_call_or_json"]

# Compact JSON: no whitespace between tokens (llguidance's JSON compiler option).
_COMPACT = {"whitespace_flexible": False}


class ConstraintError(RuntimeError):
    """The grammar cannot be compiled, or a sampled token broke it (a bug: masks forbid that)."""


@dataclass(frozen=True)
class Constraint:
    """A grammar for one turn (immutable, hashable, cheap to pass around).

    Attributes:
        kind: what it enforces (``tool_call``, ``json`` or ``tool_call_or_json``).
        grammar: the llguidance grammar (Lark syntax with ``%json`` schemas).
    """

    kind: ConstraintKind
    grammar: str


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists
    ``properties`` and leaves ``additionalProperties`` unsaid (recursively).

    >>> closed({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}})
    {'type': 'object', 'properties': {'a': {'type': 'object', 'properties': {}, 'additionalProperties': False}}, 'additionalProperties': False}
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k in _SUBSCHEMAS else v) for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(sub) for name, sub in schema[k].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


INT64_MAX = 2**63 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def check_integer_bounds(schema: Any) -> None:
    """Refuse an integer schema (anywhere in ``schema``) whose bound lies beyond int64.

    llguidance clamps such bounds to +-(2**63 - 1): ``{"type": "integer", "minimum":
    10**20, "maximum": 10**20 + 3}`` compiles and then yields 9223372036854775807, a value
    the schema rejects. A bound beyond int64 is therefore refused before generation.

    Raises:
        ConstraintError: naming the keyword and its value.

    >>> check_integer_bounds({"type": "object", "properties": {"n": {"type": "integer", "maximum": 10}}})
    >>> check_integer_bounds({"items": {"type": ["integer", "null"], "minimum": -2**64}})
    Traceback (most recent call last):
    ...
    selfrl.chat.constrain.ConstraintError: the schema bounds an integer beyond int64 (minimum = -18446744073709551616); the grammar engine clamps such bounds to +-(2**63 - 1) and would produce values the schema rejects
    """
    if isinstance(schema, list):
        for sub in schema:
            check_integer_bounds(sub)
        return
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        for key in _BOUNDS:
            v = schema.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > INT64_MAX:
                raise ConstraintError(f"the schema bounds an integer beyond int64 ({key} = {v}); the grammar engine "
                                      "clamps such bounds to +-(2**63 - 1) and would produce values the schema rejects")
    for v in schema.values():
        if isinstance(v, (dict, list)):
            check_integer_bounds(v)


_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties", "not", "then", "else", "if")


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    schema = closed(schema)
    return {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#``, ``#/$defs/X``) pointing below ``base``,
    a JSON pointer to where ``schema`` sits inside a larger document.

    A tool's ``parameters`` are a schema document of their own: its ``#`` is its own root.
    Embedded in the call grammar's schema (``{"name": ..., "arguments": <parameters>}``) a
    ``$ref`` would otherwise resolve against the call's root: ``{"$ref": "#"}`` would mean
    "another whole call", and ``#/$defs/X`` a definition the call schema does not have.

    >>> rebase_refs({"items": {"$ref": "#/$defs/n"}, "$defs": {"n": {"$ref": "#"}}}, "#/$defs/t0")
    {'items': {'$ref': '#/$defs/t0/$defs/n'}, '$defs': {'n': {'$ref': '#/$defs/t0'}}}
    """
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def _call_schema(tools: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One call of one of ``tools``; each tool's parameters sit in ``$defs`` under
    ``selfrl_tool_<i>``, their own ``$ref`` rebased there (:func:`rebase_refs`)."""
    defs = {f"selfrl_tool_{i}": rebase_refs(params or {"type": "object"}, f"#/$defs/selfrl_tool_{i}")
            for i, (_, params) in enumerate(tools)}
    alternatives = [{
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/selfrl_tool_{i}"}},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for i, (name, _) in enumerate(tools)]
    root = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return _compact({**root, "$defs": defs})


def _lark(rules: list[str]) -> str:
    return "\n".join(rules) + "\n"


def tool_call_constraint(tools: list[tuple[str, dict[str, Any]]], name: str | None = None,
                         answer_schema: dict[str, Any] | None = None) -> Constraint:
    """One tool call (of ``name`` only, when given), or, with ``answer_schema``, either a
    tool call or a JSON answer valid against it.

    Args:
        tools: ``(name, JSON schema of the arguments)`` per offered tool.
        name: the only tool that may be called.
        answer_schema: allow a JSON answer instead of a call (tool_choice "auto" with a
            JSON ``response_format``).

    Raises:
        ValueError: no tools, or ``name`` is not one of them.

    >>> c = tool_call_constraint([("add", {"type": "object"})])
    >>> c.kind, c.grammar.splitlines()[0]
    ('tool_call', 'start: call')
    """
    if not tools:
        raise ValueError("a tool-call constraint needs at least one tool")
    if name is not None:
        tools = [t for t in tools if t[0] == name]
        if not tools:
            raise ValueError(f"tool {name!r} is not among the tools offered")
    rules = ["start: call" if answer_schema is None else "start: call | answer",
             f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}",
             f"body: %json {json.dumps(_call_schema(tools))}"]
    if answer_schema is not None:
        rules.append(f"answer: %json {json.dumps(_compact(answer_schema))}")
    return Constraint("tool_call" if answer_schema is None else "tool_call_or_json", _lark(rules))


def json_constraint(schema: dict[str, Any] | None = None) -> Constraint:
    """One JSON value valid against ``schema`` (None: any JSON object, OpenAI's ``json_object``).

    >>> json_constraint().kind
    'json'
    """
    schema = {"type": "object"} if schema is None else schema
    return Constraint("json", _lark([f"start: %json {json.dumps(_compact(schema))}"]))


# ------------------------------------------------------------------ tokenizers and matchers

_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of a Hugging Face fast tokenizer (about 2 s to build for a 49k
    vocabulary; cached per tokenizer object, vocabulary size and EOS ids).

    Raises:
        ConstraintError: the tokenizer is not a fast (Rust) tokenizer.
    """
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            import llguidance.hf

            try:
                _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)))
            except ValueError as e:
                raise ConstraintError(f"constrained decoding needs a fast tokenizer: {e}") from e
        return _TOKENIZERS[key][1]


_CHECKED: OrderedDict[tuple, str | None] = OrderedDict()  # check_constraint's verdicts (error or None), LRU
_CHECKED_SIZE = 512
_CHECKED_MAX_CHARS = 65536  # longer grammars are checked every time, never held
_CHECKED_LOCK = threading.Lock()
PREFLIGHT_STEPS = 8  # choices a preflight walk makes on a fresh matcher (check_constraint)
PREFLIGHT_FORCED = 4096  # the most forced tokens in a row it accepts (a schema's consts and keys)


def check_constraint(constraint: Constraint, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Compile ``constraint`` and take its first steps, so that a grammar that cannot be
    decoded is refused before any generation starts.

    Two kinds of failure: it does not compile (an unsupported JSON-schema keyword, an
    invalid ``pattern``, a ``$ref`` to nothing, ``minItems`` over ``maxItems``), or it
    compiles but fails as soon as decoding starts. The second is a schema with no finite
    value: ``{"$ref": "#"}`` as a tool's arguments, or a ``$ref`` cycle through required
    properties, forces an endless prefix, and llguidance stops at its item limit ("Too many
    items") on the first sampled token. So a fresh matcher is walked as decoding would:
    :data:`PREFLIGHT_STEPS` choices (the lowest allowed non-EOS id each), each followed by
    the tokens it then forces (at most :data:`PREFLIGHT_FORCED` in a row).

    A verdict is remembered for the last :data:`_CHECKED_SIZE` grammars of up to
    :data:`_CHECKED_MAX_CHARS` characters (a client sends the same tools with every request).

    Raises:
        ConstraintError: either failure, with llguidance's reason (its first line).
    """
    key = (constraint.grammar, id(tokenizer), vocab_size, tuple(eos_token_ids))
    with _CHECKED_LOCK:
        known = _CHECKED.get(key, ...)
        if known is not ...:
            _CHECKED.move_to_end(key)
    if known is ...:
        try:
            _check_constraint(constraint, tokenizer, vocab_size, eos_token_ids)
            known = None
        except ConstraintError as e:
            known = str(e)
        if len(constraint.grammar) <= _CHECKED_MAX_CHARS:
            with _CHECKED_LOCK:
                _CHECKED[key] = known
                while len(_CHECKED) > _CHECKED_SIZE:
                    _CHECKED.popitem(last=False)
    if known is not None:
        raise ConstraintError(known)


def _check_constraint(constraint: Constraint, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
    """:func:`check_constraint` without its memory."""
    import llguidance

    llt = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
    bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(constraint.grammar, llt)
    if bad:  # llguidance's message quotes the whole grammar after its first line: a huge enum's, say
        reasons = "; ".join(m.strip().splitlines()[0].split(": ", 1)[-1] for m in messages if m.strip())
        raise ConstraintError(f"the {constraint.kind} grammar cannot be compiled: {reasons}")
    matcher = llguidance.LLMatcher(llt, constraint.grammar, log_level=0)
    eos = set(eos_token_ids)
    for _ in range(PREFLIGHT_STEPS):
        if matcher.is_error():
            break
        allowed = unpack_mask(matcher.compute_bitmask(), vocab_size).nonzero().flatten().tolist()
        if matcher.is_error():
            break
        ids = [t for t in allowed if t not in eos]
        if not ids:
            if allowed:
                return  # complete: only an end of turn is left
            raise ConstraintError(f"the {constraint.kind} grammar allows no token at all")
        matcher.consume_token(ids[0])
        forced = [] if matcher.is_error() else matcher.compute_ff_tokens()  # the text no choice is left in
        if len(forced) > PREFLIGHT_FORCED:
            raise ConstraintError(f"the {constraint.kind} grammar forces more than {PREFLIGHT_FORCED} tokens in a "
                                  "row: the schema has no finite value (it requires itself: a \"$ref\" cycle "
                                  "through required properties, or {\"$ref\": \"#\"})")
        if forced:
            matcher.consume_tokens(forced)
    if matcher.is_error():
        reason = matcher.get_error().strip().splitlines()[0]
        hint = ""
        if "Too many items" in reason:
            hint = ("; the schema has no finite value (it requires itself: a \"$ref\" cycle through required "
                    "properties, or {\"$ref\": \"#\"})")
        elif "NoExtension" in reason:
            hint = "; the schema admits no JSON value (a \"$ref\" that only refers to itself)"
        raise ConstraintError(f"the {constraint.kind} grammar fails when decoding starts: {reason}{hint}")


def unpack_mask(bitmask: bytes | np.ndarray, vocab_size: int) -> torch.Tensor:
    """(V,) bool: token i allowed, from llguidance's little-endian bitmask (one bit per id).

    >>> unpack_mask(bytes([0b101, 0, 0, 0]), 4).tolist()
    [True, False, True, False]
    """
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


class GrammarMasks:
    """A Hugging Face logits processor that applies one grammar per row of a batch.

    Rows whose constraint is None are left alone. Before each step it feeds the row's
    previous sampled id to its matcher, then sets every id the grammar forbids to
    ``-inf``. A row that sampled an EOS is done (later columns are padding). It keeps
    each constrained row's masks (packed, V/8 bytes a step) so the engine can record
    the masked distribution's logprobs.

    A row whose grammar fails mid-generation (a sampled id it cannot take, a parser
    error such as llguidance's "Too many items" for a schema with no finite value that
    the preflight did not reach, a mask that allows no id) fails alone: its reason goes
    to ``errors[row]`` and the row is ended with an EOS (the engine drops that id and
    reports the reason on the row's :class:`~selfrl.engines.base.Generation`); the
    batch's other rows go on.

    Args:
        constraints: B constraints or None.
        tokenizer: the policy's fast tokenizer.
        vocab_size: V, the width of the logits.
        eos_token_ids: ids that end a turn (allowed once the grammar is complete).
        prompt_width: P, the padded prompt width (columns before the first sampled id).

    Raises:
        ConstraintError: a grammar does not compile.
    """

    def __init__(self, constraints: list[Constraint | None], tokenizer, vocab_size: int,
                 eos_token_ids: list[int], prompt_width: int):
        import llguidance

        llt = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size, self.width, self.eos = vocab_size, prompt_width, set(eos_token_ids)
        self.matchers = []
        for c in constraints:
            m = None if c is None else llguidance.LLMatcher(llt, c.grammar, log_level=0)
            if m is not None and m.is_error():
                raise ConstraintError(f"the {c.kind} grammar cannot be compiled: {m.get_error()}")
            self.matchers.append(m)
        self.done = [m is None for m in self.matchers]
        self.masks: list[list[bytes]] = [[] for _ in constraints]  # per row, per step: packed allowed ids
        self.errors: list[str | None] = [None for _ in constraints]  # per row: why its grammar failed
        self._end = min(eos_token_ids)  # the id a failed row is ended with

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width  # ids sampled so far per row
        for i, m in enumerate(self.matchers):
            if self.done[i]:
                continue
            if step > 0:
                last = int(input_ids[i, -1])
                if last in self.eos:
                    self.done[i] = True
                    continue
                if not m.consume_token(last):
                    self._fail(i, scores, f"sampled id {last} broke the grammar at step {step - 1}: {m.get_error()}")
                    continue
            packed = m.compute_bitmask()
            if m.is_error():  # never sample from an error's mask: it may allow only an end of turn
                self._fail(i, scores, f"the grammar failed at step {step}: {m.get_error()}")
                continue
            allowed = unpack_mask(packed, scores.shape[-1])  # (V,)
            if not allowed.any():
                self._fail(i, scores, f"the grammar allows no token at step {step}")
                continue
            self.masks[i].append(packed)
            scores[i] = scores[i].masked_fill(~allowed.to(scores.device), float("-inf"))
        return scores

    def _fail(self, row: int, scores: torch.Tensor, reason: str) -> None:
        """End ``row`` now (only its EOS id left to sample) and remember why (its first line)."""
        self.errors[row] = reason.strip().splitlines()[0]
        self.done[row] = True
        end = torch.full_like(scores[row], float("-inf"))  # (V,)
        end[self._end] = 0.0
        scores[row] = end

    def masked_logps(self, row: int, logits: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        """The row's log-probabilities under the masked distribution it sampled from, and
        which steps the mask restricted.

        Args:
            row: the batch row.
            logits: (N, V) the row's logits divided by the temperature.

        Returns:
            (N, V) ``log_softmax`` over the allowed ids where a mask applied (``-inf`` at
            the others), over all ids elsewhere; and N flags, True where the mask removed
            at least one id.
        """
        n = logits.shape[0]
        allowed = torch.ones(n, logits.shape[-1], dtype=torch.bool)  # (N, V)
        for k in range(min(len(self.masks[row]), n)):
            allowed[k] = unpack_mask(self.masks[row][k], logits.shape[-1])
        restricted = (~allowed).any(dim=-1)  # (N,)
        return torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1), restricted.tolist()


def replay_masks(constraint: Constraint, token_ids: list[int], tokenizer, vocab_size: int,
                 eos_token_ids: list[int]) -> torch.Tensor:
    """The masks a grammar applied while ``token_ids`` were sampled, recomputed.

    The matcher is deterministic in the ids it consumed, so feeding it the sampled ids
    again gives, before each id, the same set of allowed ids as at sampling time. The
    learner uses it to recompute a constrained token's log-probability under the masked
    distribution it was sampled from (the behaviour policy), so that grammar-constrained
    turns train with an importance ratio of exactly 1 for an unchanged policy.

    Args:
        constraint: the turn's grammar.
        token_ids: (n,) the ids sampled in that turn, in order (its EOS included, if sampled).
        tokenizer: the policy's fast tokenizer; vocab_size: V; eos_token_ids: as at sampling.

    Returns:
        (n, V) bool: row k is the set of ids allowed before ``token_ids[k]``. Rows after
        the grammar completed (an EOS the grammar allowed) allow everything.

    Raises:
        ConstraintError: the grammar does not compile, or an id is one it forbade (the
            ids were not sampled under this grammar).
    """
    import llguidance

    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, vocab_size, eos_token_ids), constraint.grammar,
                                   log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"the {constraint.kind} grammar cannot be compiled: {matcher.get_error()}")
    eos = set(eos_token_ids)
    allowed = torch.ones(len(token_ids), vocab_size, dtype=torch.bool)  # (n, V)
    for k, tid in enumerate(token_ids):
        allowed[k] = unpack_mask(matcher.compute_bitmask(), vocab_size)
        if not allowed[k, tid]:
            raise ConstraintError(f"id {tid} at step {k} is not allowed by the {constraint.kind} grammar")
        if tid in eos:
            break
        if not matcher.consume_token(tid):
            raise ConstraintError(f"id {tid} at step {k} broke the {constraint.kind} grammar: {matcher.get_error()}")
    return allowed
