"""The slot engine's decoding pass: one id a row, or a few with drafts, chosen and recorded.

A pass decodes every active row (:meth:`SlotDecode._decode`). When the pass is small enough to be
bound by reading the weights (few rows, :func:`~selfrl.engines.drafts.draft_width`) and no row has
a grammar, each row is fed its last id and the ids drafted from its own context
(:func:`~selfrl.engines.drafts.lookup_draft`), and keeps those the model chooses itself
(:func:`~selfrl.engines.drafts.verify_drafts`): exact, so the ids and logprobs are those of one
step an id, up to rounding. Every chosen id is then recorded the same way
(:meth:`SlotDecode._record`): appended with its logprob, streamed, checked against the row's end
(EOS, a stop string, its token limit), and the rows that end free their slots. A mixin of
:class:`selfrl.engines.slots.SlotEngine`, whose attributes it uses (``cache``, ``model``,
``merged``, ``_rows``, ``_finish``, ``_keep_continuation``, ...).
"""

from __future__ import annotations

import torch

from selfrl.chat.constrain import ConstraintError
from dataclasses import dataclass, field

from selfrl.engines.drafts import draft_width, lookup_draft, verify_drafts
from selfrl.engines.packedattention import Segment
from selfrl.engines.sharedattention import SharedPrefix
from selfrl.engines.sampling import choose_tokens, next_token_logps
from selfrl.engines.slotattention import additive_mask
from selfrl.engines.slotrequest import Call, Request

Chosen = tuple[int, float, list[tuple[int, float]] | None]  # (id, logprob, top alternatives or None)


@dataclass
class Pass:
    """One forward pass of the slot engine over a contiguous range of slots: a prefill of admitted
    rows, or a decoding pass. Run alone (:meth:`SlotDecode._run_pass`) or packed with the step's other
    pass (:meth:`SlotDecode._run_packed`).

    Attributes:
        rows: the slots, ``b`` of them.
        ids, pos, cols: (b, T) long: input ids, their positions, and the cache column each is written
            to (the scratch column for padding, which no mask shows).
        real: (b, T) bool, the places that are not padding (what a packed pass keeps: the cache may
            grow, and its scratch column move, between building a pass and running it packed).
        mask: (b, 1, T, width) bool, ``column <= position``.
        width: the columns the rows' attention reads.
        shared: the stored prefix every row starts with, attended once for all (or None).
        keep: the last ``keep`` places of each row whose logits are wanted.
        drafts: a decoding pass's drafted ids per row (:mod:`selfrl.engines.drafts`).
    """

    rows: slice
    ids: torch.Tensor
    pos: torch.Tensor
    cols: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor
    width: int
    shared: SharedPrefix | None = None
    keep: int = 1
    drafts: list[list[int]] = field(default_factory=list)


def _alternatives(top, j: int, n: int) -> list[tuple[int, float]] | None:
    """The ``n`` most likely (id, logprob) pairs of row ``j`` of a ``topk`` result (None: no ``top``)."""
    if top is None:
        return None
    return list(zip(top.indices[j, :n].tolist(), top.values[j, :n].tolist()))


class SlotDecode:
    """The decoding half of :class:`~selfrl.engines.slots.SlotEngine` (see the module docstring)."""

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 keep: int = 1) -> torch.Tensor:
        """(b, V) fp32 logits of the last input position of every row; with ``keep`` > 1,
        (b, keep, V) of the last ``keep`` positions."""
        if self.attention == "eager":  # eager attention adds its mask to the scores
            mask = additive_mask(mask, self.model.get_input_embeddings().weight.dtype)
        out = (self.merged or self.model)(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                          cache=self.cache, use_cache=True, logits_to_keep=keep)
        if self.cache.shared is not None:  # (still set: the view attended to it once for all rows)
            self.shared_prefix_passes += 1
        logits = out.logits[:, -keep:].float()
        return logits[:, -1] if keep == 1 else logits

    def _decode(self) -> None:
        """One decoding pass over the active rows: one id each, or with drafts a few."""
        p = self._decode_pass(self._rows)
        self._decode_chosen(self._rows, p, self._run_pass(p))

    def _decode_pass(self, rows: list[Request]) -> Pass:
        """The decoding pass of ``rows`` (slots 0 to B - 1): each row's last id, then the ids drafted
        for it (:meth:`_drafts`), padding after them written to the scratch column."""
        chosen = self._drafts(rows)
        lens = torch.tensor([r.length for r in rows])  # (B,) the last id goes to column lens
        T = 1 + max(map(len, chosen), default=0)
        B = len(rows)
        if T == 1:
            pos = cols = lens[:, None]  # (B, 1)
            real = torch.ones(B, 1, dtype=torch.bool)
        else:  # row i: its last id, then its drafted ids, then padding (written to the scratch column)
            fed = torch.tensor([1 + len(d) for d in chosen])  # (B,)
            real = torch.arange(T)[None, :] < fed[:, None]  # (B, T)
            pos = lens[:, None] + torch.minimum(torch.arange(T)[None, :], fed[:, None] - 1)  # (B, T) padding repeats
            cols = torch.where(real, pos, self.cache.scratch)
        width = int(pos.max()) + 1
        mask = (torch.arange(width)[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, T, W)
        ids = torch.tensor([[r.token_ids[-1], *d] + [self.pad_token_id] * (T - 1 - len(d))
                            for r, d in zip(rows, chosen)])  # (B, T)
        return Pass(slice(0, B), ids, pos, cols, real, mask, width, self._shared_prefix(rows), keep=T, drafts=chosen)

    def _decode_chosen(self, rows: list[Request], p: Pass, logits: torch.Tensor) -> None:
        """Choose and record each row's ids from its decoding pass ``p``'s ``logits`` ((B, V), or
        (B, T, V) with drafts)."""
        self.steps += 1
        if p.keep == 1:
            self._sample(rows, logits, fed=True)
        else:
            self._speculate(rows, p.drafts, logits)

    def _run_pass(self, p: Pass) -> torch.Tensor:
        """Run pass ``p`` alone; its (b, V) logits, or (b, keep, V) with ``keep`` > 1."""
        b, T = p.ids.shape
        slots = torch.arange(p.rows.start, p.rows.start + b)[:, None].expand(b, T)
        self.cache.set_pass(p.rows, p.width, slots, p.cols, shared=p.shared)
        return self._forward(p.ids, p.pos, p.mask, keep=p.keep)

    def _packs(self) -> bool:
        """Whether the passes of a step can run as one packed forward pass
        (:mod:`selfrl.engines.packedattention`): the merged view runs with its own attention everywhere."""
        return self.merged is not None and self.merged.takes_packed()

    def _run_packed(self, passes: list[Pass]) -> list[torch.Tensor]:
        """Run ``passes`` as one forward pass, their real tokens end to end (padding dropped); each
        pass's logits as :meth:`_run_pass` would give them ((b, V), or (b, keep, V)). A kept place that
        holds padding (a drafted pass's row with fewer drafts) gets its row's last real token's logits,
        which nothing reads."""
        ids, pos, slots, cols, segments, keep = [], [], [], [], [], []
        offset = 0
        for p in passes:
            b, T = p.ids.shape
            row, query = p.real.nonzero(as_tuple=True)  # (n,) each, row by row
            tokens = torch.arange(offset, offset + len(row))  # (n,)
            ids.append(p.ids[row, query])
            pos.append(p.pos[row, query])
            slots.append(p.rows.start + row)
            cols.append(p.cols[row, query])
            segments.append(Segment(p.rows, p.width, tokens, row, query, p.mask, p.shared))
            at = torch.full((b, T), -1, dtype=torch.long)  # (b, T) each grid place's token, -1: padding
            at[row, query] = tokens
            last = at[:, T - p.keep:]  # (b, keep)
            keep.append(torch.where(last < 0, at.amax(dim=1, keepdim=True), last))
            offset += len(row)
        self.cache.set_packed(torch.cat(slots)[None], torch.cat(cols)[None], segments)
        wanted = torch.cat([k.reshape(-1) for k in keep])
        kept, where = torch.unique(wanted, sorted=True, return_inverse=True)  # logits only where read
        out = self.merged(input_ids=torch.cat(ids)[None], position_ids=torch.cat(pos)[None],
                          attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), cache=self.cache,
                          use_cache=True, logits_to_keep=kept)
        self.cache.segments = None
        self.shared_prefix_passes += sum(s.shared is not None for s in segments)
        self.packed_passes += 1
        logits = out.logits[0].float()[where]  # (sum of b x keep, V)
        result, start = [], 0
        for p, k in zip(passes, keep):
            n = k.numel()
            block = logits[start:start + n].view(*k.shape, -1)  # (b, keep, V)
            result.append(block[:, 0] if p.keep == 1 else block)
            start += n
        return result

    def _drafts(self, rows: list[Request]) -> list[list[int]]:
        """Each row's drafted ids for this pass (:mod:`selfrl.engines.drafts`): none when drafts are
        off, the pass is too large, or a row has a grammar (whose mask depends on each id chosen)."""
        k = draft_width(len(rows), self.draft_ids, self.draft_budget)
        if not k or any(r.grammar is not None for r in rows):
            return [[] for _ in rows]
        # at most the row's ids left but one: the last chosen id is never fed, so its column stays in the cache
        return [lookup_draft(r.prompt + r.token_ids, min(k, r.max_new_tokens - len(r.token_ids) - 1))
                for r in rows]

    def _speculate(self, rows: list[Request], drafts: list[list[int]], logits: torch.Tensor) -> None:
        """Choose and record the ids each row keeps from a pass over its drafts; ``logits`` (B, T, V)."""
        B, T, V = logits.shape
        greedy = torch.tensor([r.greedy for r in rows])  # (B,)
        temps = torch.tensor([r.temperature for r in rows])  # (B,)
        logp = next_token_logps(logits.reshape(B * T, V), temps.repeat_interleave(T),
                                greedy.repeat_interleave(T)).view(B, T, V)
        gone = self._fail_nan(rows, logp[:, 0])
        if gone:
            keep = [i for i in range(B) if rows[i] not in gone]
            rows, drafts, logp, greedy = [rows[i] for i in keep], [drafts[i] for i in keep], logp[keep], greedy[keep]
        chosen = verify_drafts(logp, drafts, greedy, torch.tensor([r.top_p for r in rows]),
                               [r.generator for r in rows]) if rows else []
        self.drafted_ids += sum(map(len, drafts))
        self.accepted_ids += sum(len(c) - 1 for c in chosen)
        self.draft_passes += 1
        k = max((r.top_logprobs for r in rows), default=0)
        out = []
        for i, (r, ids) in enumerate(zip(rows, chosen)):
            at = logp[i, :len(ids)]  # (n, V)
            lps = at.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()
            top = at.topk(min(k, V), dim=-1) if k else None
            out.append([(t, lp, _alternatives(top, j, r.top_logprobs)) for j, (t, lp) in enumerate(zip(ids, lps))])
        self._record(rows, out, None, fed=True, gone=gone)

    def _fail_nan(self, rows: list[Request], logp: torch.Tensor) -> list[Request]:
        """Fail the rows whose (B, V) ``logp`` is NaN (NaN or infinite logits: a diverged adapter fails
        them all; the others go on); returns them (their slots are freed by :meth:`_record`)."""
        broken = torch.isnan(logp.amax(dim=-1)).nonzero().squeeze(-1).tolist()
        for i in broken:
            self._finish(rows[i], error=ValueError("cannot choose a token: the row's log-probabilities are NaN "
                                                   "(its logits are NaN or infinite)"))
        return [rows[i] for i in broken]

    def _sample(self, rows: list[Request], logits: torch.Tensor, fed: bool = False) -> None:
        """Choose the next id of each of ``rows`` from its (B, V) ``logits`` and record it
        (:meth:`_record`; ``fed``: the pass fed each row's last id, now in the cache)."""
        allowed = None  # (B, V) the ids each row's grammar allows
        gone: list[Request] = []  # rows that end here, failed (freed with the others by _record)
        if any(r.grammar is not None for r in rows):
            allowed = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool)
            for i, r in enumerate(rows):
                if r.grammar is not None:
                    try:
                        allowed[i] = r.grammar.allowed()
                    except ConstraintError as e:  # this row ends here (Generation.grammar_error); the others go on
                        gone.append(r)
                        self._finish(r, r.result(False, grammar_error=str(e)))
        greedy = torch.tensor([r.greedy for r in rows])  # (B,)
        logp = next_token_logps(logits, torch.tensor([r.temperature for r in rows]), greedy, allowed)  # (B, V)
        gone += [r for r in self._fail_nan(rows, logp) if r not in gone]
        if gone:
            keep = [i for i in range(len(rows)) if rows[i] not in gone]
            rows, logp, greedy = [rows[i] for i in keep], logp[keep], greedy[keep]
            allowed = None if allowed is None else allowed[keep]
        if not rows:
            self._record([], [], None, fed, gone)
            return
        ids = choose_tokens(logp, greedy, torch.tensor([r.top_p for r in rows]), [r.generator for r in rows])  # (B,)
        logps = logp.gather(-1, ids[:, None]).squeeze(-1)  # (B,)
        k = max(r.top_logprobs for r in rows)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1) if k else None  # (B, k) values and indices
        chosen = [[(t, lp, _alternatives(top, i, r.top_logprobs))]
                  for i, (r, t, lp) in enumerate(zip(rows, ids.tolist(), logps.tolist()))]
        self._record(rows, chosen, allowed, fed, gone)

    def _record(self, rows: list[Request], chosen: list[list[Chosen]], allowed: torch.Tensor | None,
                fed: bool, gone: list[Request] = ()) -> None:
        """Append each row's chosen ids in order (with ``fed``, each id chosen after a fed one: the
        row's cache length grows by one an id), stream them, and finish the rows that end: at EOS,
        a stop string or the token limit, the ids after it are dropped; after an id whose streaming
        set the row's cancel event too (it ends before the next pass). Then free the slots of
        those and of ``gone`` (rows already finished in this pass: every length is counted before a
        row moves). ``allowed`` (B, V): the grammar rows' masks (one id a row then)."""
        done, calls = [], {}
        for i, r in enumerate(rows):
            for t, lp, alts in chosen[i]:
                if fed:
                    r.length += 1
                r.token_ids.append(t)
                r.logprobs.append(lp)
                if r.top is not None:
                    r.top.append(alts)
                if r.grammar is not None:
                    r.constrained.append(bool((~allowed[i]).any()))
                    try:
                        r.grammar.advance(t)
                    except Exception as e:  # this row ends (a schema's failure: grammar_error; a bug: its future raises)
                        done.append(i)
                        if isinstance(e, ConstraintError):
                            self._finish(r, r.result(False, grammar_error=str(e)))
                        else:
                            self._finish(r, error=e)
                        break
                try:
                    r.report()
                except Exception as e:  # a streaming callback that raises fails its own row only
                    done.append(i)
                    self._finish(r, error=e)
                    break
                if r.call is not None:
                    calls[id(r.call)] = r.call
                stopped = bool(r.stop) and t not in self._eos and any(
                    s in self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for s in r.stop)
                if t in self._eos or stopped or len(r.token_ids) >= r.max_new_tokens:
                    done.append(i)
                    self.rows_done += 1
                    self._keep_continuation(r)
                    self._finish(r, r.result(t in self._eos or stopped, stopped=stopped))
                    break
                if r.cancel is not None and r.cancel.is_set():  # (set while streaming: no id after it, as one
                    break                                      # id a pass would give; it ends before the next)
        for c in calls.values():
            try:
                c.emit()
            except Exception as e:  # an on_step hook that raises fails its own generate call only
                self._fail_call(c, e, rows, done)
        self._release([self._rows.index(r) for r in [*gone, *(rows[i] for i in set(done))]])

    def _fail_call(self, call: Call, error: BaseException, rows: list[Request], done: list[int]) -> None:
        """Fail every unsettled request of ``call`` with ``error``: queued ones leave the queue,
        running ones among ``rows`` are added to ``done`` (their slots are freed by the caller)."""
        with self._cond:
            for r in call.requests:
                if r in self._queue:
                    self._queue.remove(r)
        for r in call.requests:
            if r in rows and rows.index(r) not in done:
                done.append(rows.index(r))
            self._finish(r, error=error)

    def _release(self, done: list[int]) -> None:
        """Free the slots of finished rows, moving the last rows into the holes."""
        rows = self._rows
        for i in sorted(done, reverse=True):
            last = len(rows) - 1
            if i != last:
                self.cache.move_row(last, i, rows[last].length)
                rows[i] = rows[last]
            rows.pop()
