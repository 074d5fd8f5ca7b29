"""Admission into the slot engine: new rows' prompts prefilled into their slots.

What is encoded is only what nothing stored already holds: a prefix common to the rows admitted
together, or stored from an earlier request (:class:`~selfrl.engines.kvcache.PrefixStore`); the
finished row a prompt continues (:class:`~selfrl.engines.kvcache.ContinuationStore`); and a prompt
repeated among the rows admitted together, encoded once and copied. Each row remembers the stored
prefix it starts with, so that a pass whose rows all share one attends to it once
(:mod:`selfrl.engines.sharedattention`). Both stores are dropped when
the weights change (:class:`~selfrl.engines.weightwatch.WeightWatch`). A mixin of
:class:`selfrl.engines.slots.SlotEngine`, whose attributes it uses (``cache``, ``watch``,
``_prefixes``, ``_continuations``, ``_forward``, ...).
"""

from __future__ import annotations

import torch

from selfrl.engines.sharedattention import SharedPrefix
from selfrl.engines.slotdecode import Pass
from selfrl.engines.slotrequest import Request
from selfrl.model.prefix import MIN_SHARED_PREFIX, group_repeats, shared_prefix_len


class SlotPrefill:
    """The admission half of :class:`~selfrl.engines.slots.SlotEngine` (see the module docstring)."""

    def _keep_continuation(self, r: Request) -> None:
        """Keep finished row ``r``'s keys and values (its prompt and every sampled id but the last,
        which was never fed back) for a request that continues it; not when the weights changed
        since the row was prefilled (its keys and values mix two versions)."""
        if not self._continuations.max_bytes or r.length < self._continuations.min_len:
            return
        if self.watch.poll() == r.generation:  # (the fast look, 0.3 ms)
            tokens = (r.prompt + r.token_ids)[:r.length]
            self._continuations.add(tokens, self.cache.read_row(self._rows.index(r), r.length))

    def _shared_prefix(self, rows: list[Request]) -> SharedPrefix | None:
        """The stored prefix every row of a pass (decoding, or a prefill) starts with, to be attended once
        for all of them (:mod:`selfrl.engines.sharedattention`), or None: fewer than two rows, a row without one,
        rows of different prefixes (other prompts, or prefilled before the weights changed), or no
        merged view whose attention takes it (``shared_prefix_attention`` off, an unsupported model)."""
        if not self._shared_attention():
            return None
        first = rows[0].shared
        if len(rows) < 2 or first is None or any(r.shared is None or r.shared[0] is not first[0] for r in rows):
            return None
        return SharedPrefix(min(r.shared[2] for r in rows), first[0], first[1])

    def _shared_attention(self) -> bool:
        """Whether a pass may attend to a shared prefix once for all its rows: ``shared_prefix_attention``
        and a merged view whose attention layers all take it."""
        return bool(self.shared_prefix_attention and self.merged is not None and self.merged.shared_prefix_layers)

    def _store_prefix(self, tokens: list[int], slot: int) -> None:
        self._prefixes.add(tokens, *self.cache.read_prefix(slot, len(tokens)))

    def _prefill(self, new: list[Request], decode: Pass | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode the prompts of ``new`` rows into the slots after the active ones; returns their
        (b, V) next-token logits, and with ``decode`` (the active rows' decoding pass) that pass's
        logits too: both passes then run as one packed forward pass
        (:mod:`selfrl.engines.packedattention`). With ``share_prefix``, a prompt repeated in ``new``
        (a group's ``num_generations`` samples) is encoded once and its keys, values and logits
        copied: such rows move to the end of ``new`` (in place), so the rows encoded are a contiguous
        window."""
        first = len(self._rows)
        self.cache.ensure(first + len(new), max(len(r.prompt) + r.max_new_tokens for r in new), used=first)
        # every kind of change (about 20 ms) when rows join an idle engine, where a learner or a swap
        # changes the weights; the fast look (0.3 ms: every version counter) when they join running rows
        generation = self.watch.poll(deep=not self._rows)  # (the merged view follows at its next call)
        if self.share_prefix and generation != self._prefix_generation:
            self._prefixes.clear()  # the weights moved (a swap, an update in place, adapters switched)
            self._continuations.clear()
            self._prefix_generation = generation
        for r in new:
            r.generation = generation
        copies: list[int] = []  # for each row after the encoded ones: the index of the row it repeats
        if self.share_prefix:
            order, copies = group_repeats([r.prompt for r in new])
            new[:] = [new[i] for i in order]
        n = len(new) - len(copies)  # rows encoded
        p, starts = self._prompt_pass(first, new[:n])
        if decode is None:
            logits, decoded = self._run_pass(p), None
        else:
            logits, decoded = self._run_packed([p, decode])
        self._keep_unshared_prompt(first, new[:n], starts)
        for j, k in enumerate(copies):  # (column = position: the prompt fills columns [0, len))
            r = new[n + j]
            self.cache.move_row(first + k, first + n + j, len(r.prompt))
            r.length = len(r.prompt)
            r.shared = new[k].shared
        return (torch.cat([logits, logits[copies]]) if copies else logits), decoded

    def _prompt_pass(self, first: int, new: list[Request]) -> tuple[Pass, list[int]]:
        """The prefill pass of ``new`` rows into slots ``first``, ``first + 1``, ...: what no stored
        prefix or kept row already holds, left-padded; and where each row's own part starts."""
        if self.share_prefix:
            # a prefix common to the rows admitted now, or to a generate call: encoded once
            common = shared_prefix_len([r.prompt for r in new])
            for r in new:
                hint = max(common, r.prefix_hint)
                if hint - self._prefixes.match(r.prompt)[1] < MIN_SHARED_PREFIX:
                    continue  # too short, or (nearly) all of it stored: the row prefills the rest itself
                kept = self._continuations.match(r.prompt)
                if kept is None or kept[2] < hint:  # (a row that continues a kept one needs no prefix)
                    self._encode(r.prompt[:hint], first)
        starts = []
        for k, r in enumerate(new):
            j, m = self._prefixes.match(r.prompt) if self.share_prefix else (-1, 0)
            # the stored prefix the row starts with, attended once a pass for all rows (whatever fills its slot)
            r.shared = (self._prefixes.items[j][1], self._prefixes.items[j][2], m) if j >= 0 else None
            c = self._continuations.match(r.prompt)  # (None when nothing is kept)
            slot = first + k
            if c is not None and c.length > m:  # the row this prompt continues (a rollout's last turn)
                self.cache.lend(slot, *(c.lent or ([], [], 0)))  # (what the kept row was lent, lent again)
                self.cache.load_prefix(slot, c.keys, c.values, c.length, start=c.start)
                m = c.length
                self._continuations.hits += 1
                self._continuations.hit_tokens += m
            elif j >= 0 and self._shared_attention():  # the slot is lent the prefix; a pass that reads it copies it
                self.cache.lend(slot, *self._prefixes.use(j), m)
            elif j >= 0:
                self.cache.load_prefix(slot, *self._prefixes.use(j), m)
            else:
                self.cache.lend(slot, [], [], 0)  # (nothing lent: whatever a former row left is overwritten)
            starts.append(m)
        T = max(len(r.prompt) - m for r, m in zip(new, starts))
        b = len(new)
        input_ids = torch.full((b, T), self.pad_token_id, dtype=torch.long)  # (b, T) left-padded suffixes
        pos = torch.zeros(b, T, dtype=torch.long)  # (b, T)
        cols = torch.full((b, T), self.cache.scratch, dtype=torch.long)  # (b, T) padding -> scratch column
        for i, (r, m) in enumerate(zip(new, starts)):
            n = len(r.prompt) - m
            input_ids[i, T - n:] = torch.tensor(r.prompt[m:])
            pos[i, T - n:] = torch.arange(m, len(r.prompt))
            cols[i, T - n:] = pos[i, T - n:]
            r.length = len(r.prompt)
        width = max(len(r.prompt) for r in new)
        mask = (torch.arange(width)[None, None, :] <= pos[:, :, None])[:, None]  # (b, 1, T, W)
        # every row starts at or after the stored prefix it matched: every query comes after the shared one
        return Pass(slice(first, first + b), input_ids, pos, cols, cols != self.cache.scratch, mask, width,
                    self._shared_prefix(new)), starts

    def _keep_unshared_prompt(self, first: int, new: list[Request], starts: list[int]) -> None:
        """After a prefill: with ``share_prefix``, store the first long prompt that matched nothing
        stored (a chat's system prompt may start later ones)."""
        if self.share_prefix:
            k = next((k for k, (r, m) in enumerate(zip(new, starts)) if m == 0 and len(r.prompt) > 2 * MIN_SHARED_PREFIX),
                     None)
            if k is not None:
                self._store_prefix(new[k].prompt[:-1], first + k)

    def _encode(self, tokens: list[int], slot: int) -> None:
        """Encode ``tokens`` alone into ``slot`` and keep them as a stored prefix; a stored prefix of
        them is loaded, and only the rest encoded."""
        j, m = self._prefixes.match(tokens)
        self.cache.lend(slot, [], [], 0)
        if j >= 0:
            self.cache.load_prefix(slot, *self._prefixes.use(j), m)
        n = len(tokens)
        pos = torch.arange(m, n)[None, :]  # (1, n - m)
        self.cache.set_pass(slice(slot, slot + 1), n, torch.full((1, n - m), slot), pos)
        mask = (torch.arange(n)[None, :] <= pos[0][:, None])[None, None]  # (1, 1, n - m, n)
        self._forward(torch.tensor([tokens[m:]]), pos, mask)
        self._store_prefix(tokens, slot)
