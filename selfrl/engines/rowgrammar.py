"""One row's grammar for a continuous-batching engine: the per-row counterpart of
:class:`selfrl.chat.constrain.GrammarMasks` (which masks a whole ``generate`` batch as a Hugging
Face logits processor).

A row that joins a running batch brings its own matcher; at every step the engine asks
it for the ids allowed next (:meth:`RowGrammar.allowed`), samples from the masked
distribution (:func:`selfrl.engines.sampling.next_token_logps`), and feeds it the
sampled id (:meth:`RowGrammar.advance`). The rules are the reference engine's: an EOS
ends the row (the matcher is not fed it), any other id must be accepted, and a step is
*constrained* when its mask removed at least one id.
"""

from __future__ import annotations

import torch

from selfrl.chat.constrain import Constraint, ConstraintError, grammar_tokenizer, unpack_mask


class RowGrammar:
    """The matcher of one constrained row.

    Args:
        constraint: the row's grammar.
        tokenizer: the policy's fast tokenizer.
        vocab_size: V, the width of the logits.
        eos_token_ids: ids that end a turn (allowed once the grammar is complete).

    Raises:
        ConstraintError: the grammar does not compile.
    """

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import llguidance

        self.kind, self.vocab_size, self.eos = constraint.kind, vocab_size, set(eos_token_ids)
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, vocab_size, eos_token_ids),
                                            constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the {constraint.kind} grammar cannot be compiled: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the ids the grammar allows next.

        Raises:
            ConstraintError: the grammar failed here (a parser error such as "Too many items"
                for a schema with no finite value, or no id allowed at all); never a mask
                to sample from, which might allow only an end of turn.
        """
        packed = self.matcher.compute_bitmask()
        if self.matcher.is_error():
            reason = self.matcher.get_error().strip().splitlines()[0]
            raise ConstraintError(f"the {self.kind} grammar failed: {reason}")
        mask = unpack_mask(packed, self.vocab_size)
        if not mask.any():
            raise ConstraintError(f"the {self.kind} grammar allows no token here")
        return mask

    def advance(self, token: int) -> None:
        """Feed the sampled ``token`` (an EOS ends the row and is not fed).

        Raises:
            ConstraintError: the grammar refuses it (a parser error such as "Too many items":
                a schema with no finite value that the preflight did not reach).
        """
        if token in self.eos:
            return
        if not self.matcher.consume_token(token):
            reason = self.matcher.get_error().strip().splitlines()[0]
            raise ConstraintError(f"sampled id {token} broke the {self.kind} grammar: {reason}")
