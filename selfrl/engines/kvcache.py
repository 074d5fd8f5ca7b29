"""A preallocated key/value cache with one row (slot) per sequence, for continuous batching.

Hugging Face's ``DynamicCache`` grows by concatenation at every decoding step
(``aten::cat`` took 45 % of sampling time on this machine, FINDINGS.md). Here every
layer's keys and values live in one tensor ``(slots, kv_heads, capacity + 1, head_dim)``
allocated once (it grows by half when a longer or larger batch needs it, which is
rare), and a forward pass writes its new keys and values in place at the columns
given for each token. **Column = position**: the token at position ``t`` of a row
is stored in column ``t``, so a row's mask is just ``column <= position``. The last
column is scratch: padding tokens write there and no mask ever shows it.

The object speaks the part of ``transformers``' ``Cache`` protocol a decoder layer
uses (``update(key_states, value_states, layer_idx, ...)``); the caller passes
``position_ids`` and a ready 4-D mask, so nothing else is asked of it. The active
rows of a forward pass are always a contiguous range of slots (``window``), so the
keys and values handed to attention are views, never copies. A packed pass (several passes'
tokens in one sequence, :meth:`SlotCache.set_packed`) hands attention the whole tensors instead.

**Lent prefixes.** A slot's first columns may be *lent*: a stored prefix (a batch's system prompt)
that the slot does not hold, read from the store's own tensors. A pass that attends to that prefix
once for all its rows (``shared``) never reads those columns, so admitting a row, moving it and
keeping it for its next turn copy only its own columns. Before any pass that would read a lent
column (a pass of one row, rows of different prefixes, a view that cannot attend to a shared
prefix), :meth:`SlotCache.fill` copies it in. On the demo's rollout batch the prefix is about 200
of a row's 250 columns.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from selfrl.engines.sharedattention import SharedPrefix


Layers = torch.Tensor | list[torch.Tensor]  # per layer (kv_heads, n, head_dim): stacked, or a list


def layer_bytes(x: Layers) -> int:
    """Bytes of stored keys or values, stacked or a list of layers."""
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else sum(t.numel() * t.element_size() for t in x)


class Lent(NamedTuple):
    """A stored prefix a slot's first ``length`` columns read instead of holding it: per layer
    ``keys[i]``, ``values[i]`` (kv_heads, n >= length, head_dim)."""
    keys: Layers
    values: Layers
    length: int


class Kept(NamedTuple):
    """A row's first ``length`` columns as :meth:`SlotCache.read_row` gives them: ``keys``, ``values``
    per layer (kv_heads, length - start, head_dim) for columns ``[start, length)``, and ``lent``, the
    stored prefix of the first ``start`` (None when ``start`` is 0)."""
    keys: Layers
    values: Layers
    length: int
    start: int = 0
    lent: Lent | None = None


class SlotCache:
    """Per-layer key/value storage for ``slots`` sequences of up to ``capacity`` positions.

    Every layer's keys live in one tensor ``K`` (layers, slots, kv_heads, capacity + 1, head_dim),
    and its values in ``V``, so that moving, copying out or loading a row is one operation for all
    layers, not one a layer (60 for the embedded model); ``k[i]`` and ``v[i]`` are layer ``i``'s
    views. They are allocated at the first use (the key/value head count, head size and dtype come
    from the model's own states), for ``layers`` layers (None: as many as have been used, grown
    when a later layer comes, as on a first forward pass of a bare cache).
    """

    def __init__(self, slots: int = 8, capacity: int = 256, layers: int | None = None):
        self.slots, self.capacity, self.layers = slots, capacity, layers
        self.K: torch.Tensor | None = None  # (layers, slots, kv_heads, capacity + 1, head_dim)
        self.V: torch.Tensor | None = None
        self.k: list[torch.Tensor] = []  # per layer, views of K: (slots, kv_heads, capacity + 1, head_dim)
        self.v: list[torch.Tensor] = []
        self.rows = slice(0, 0)  # the slots the current forward pass runs on
        self.width = 0  # columns visible to attention in the current pass
        self.write_rows: torch.Tensor | None = None  # (b, T) slot of each input token
        self.write_cols: torch.Tensor | None = None  # (b, T) column of each input token
        self.shared: SharedPrefix | None = None  # a prefix all rows of the pass share, attended apart
        self.segments: list | None = None  # a packed pass's segments (selfrl.engines.packedattention.Segment)
        self.lent: list[Lent | None] = [None] * slots  # per slot: the stored prefix its first columns read, if any

    # ------------------------------------------------------------------ the transformers side

    @torch.no_grad()  # the cache is never part of a graph (a pass under grad mode writes plain values)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the pass's (b, kv_heads, T, head_dim) states in place; return the window's
        (b, kv_heads, width, head_dim) keys and values (views)."""
        k, v = self._layer(layer_idx, key_states.shape[1], key_states.shape[3], key_states.dtype)
        k[self.write_rows, :, self.write_cols] = key_states.transpose(1, 2)  # (b, T, kv_heads, head_dim)
        v[self.write_rows, :, self.write_cols] = value_states.transpose(1, 2)
        if self.segments is not None:  # a packed pass: each segment's attention takes its own rows and columns
            return k, v
        start = self.shared.length if self.shared is not None else 0  # the shared prefix is attended apart
        return k[self.rows, :, start:self.width], v[self.rows, :, start:self.width]

    @torch.no_grad()
    def _layer(self, i: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (keys, values), each (slots, kv_heads, capacity + 1, head_dim), allocated
        (zeros) at the first use."""
        if self.K is None or i >= self.K.shape[0]:
            layers = max(self.layers or 0, i + 1)
            shape = (layers, self.slots, kv_heads, self.capacity + 1, head_dim)
            K, V = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            if self.K is not None:  # (a bare cache learning its layers on a first forward pass)
                K[:self.K.shape[0]], V[:self.V.shape[0]] = self.K, self.V
            self._set(K, V)
        return self.k[i], self.v[i]

    def _set(self, K: torch.Tensor, V: torch.Tensor) -> None:
        self.K, self.V = K, V
        self.k, self.v = [K[i] for i in range(K.shape[0])], [V[i] for i in range(V.shape[0])]  # (select views: unbind's may not be written under grad mode)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    # ------------------------------------------------------------------ the scheduler side

    def set_pass(self, rows: slice, width: int, write_rows: torch.Tensor, write_cols: torch.Tensor,
                 shared: SharedPrefix | None = None) -> None:
        """Set what the next forward pass reads (``rows``, first ``width`` columns) and where
        each of its (b, T) input tokens is written. With ``shared``, a prefix every row of the pass
        starts with (its first ``shared.length`` columns hold it) and every query of the pass comes
        after: ``update`` hands attention only the columns after it, and the model's attention
        reads the prefix from ``shared`` (:mod:`selfrl.engines.sharedattention`); the forward pass
        unsets it where the attention cannot (``MergedPolicy.__call__``)."""
        self.rows, self.width, self.write_rows, self.write_cols = rows, width, write_rows, write_cols
        self.shared, self.segments = shared, None
        self.fill(rows, shared.length if shared is not None else 0)

    def set_packed(self, write_rows: torch.Tensor, write_cols: torch.Tensor, segments: list) -> None:
        """Set up a packed forward pass (:mod:`selfrl.engines.packedattention`): its (1, N) tokens are
        written at ``write_rows``, ``write_cols``, and ``update`` hands attention every layer's whole
        tensors, which :func:`~selfrl.engines.packedattention.packed_attention` reads segment by segment."""
        self.write_rows, self.write_cols, self.segments, self.shared = write_rows, write_cols, segments, None
        self.rows, self.width = slice(0, self.slots), max(s.width for s in segments)
        for seg in segments:
            self.fill(seg.rows, seg.shared.length if seg.shared is not None else 0)

    def unshare(self) -> None:
        """Make the pass set by :meth:`set_pass` attend to its rows' whole columns instead of a shared
        prefix (a view whose attention cannot take one): the lent columns are copied in first."""
        self.fill(self.rows, 0)
        self.shared = None

    def fill(self, rows: slice, start: int) -> None:
        """Copy into each slot of ``rows`` its lent columns from ``start`` on, so that a pass reading
        columns ``[start, width)`` of them reads the prefix they were lent (a copy of up to the
        prefix's length per layer, once per slot)."""
        for slot in range(rows.start, rows.stop):
            lent = self.lent[slot]
            if lent is None or lent.length <= start:
                continue
            self._copy_in(slot, lent.keys, lent.values, start, lent.length, 0)
            self.lent[slot] = Lent(lent.keys, lent.values, start) if start else None

    @property
    def scratch(self) -> int:
        """The column padding tokens write to (never inside a window)."""
        return self.capacity

    @torch.no_grad()
    def ensure(self, slots: int, columns: int, used: int | None = None) -> None:
        """Make room for ``slots`` rows of ``columns`` positions; the contents of the first ``used``
        rows (default: all) are kept, the rest are zeros.

        Short of rows, the rows grow by half. Short of columns only, the columns grow by half and
        the rows shrink to at most twice ``slots``: the new tensors are zero-filled, and a batch's
        last turns (a few rows, each longer than the cache) would otherwise reallocate and copy
        every slot of the batch (1.4 s of a 20 s rollout batch on the embedded model, 64 slots)."""
        if slots <= self.slots and columns <= self.capacity:
            return
        used = self.slots if used is None else min(used, self.slots)
        if slots > self.slots:
            new_slots = max(slots, self.slots * 3 // 2)
        else:
            new_slots = max(slots, used, min(self.slots, 2 * slots))
        new_cap = max(self.capacity, columns if columns <= self.capacity else max(columns, self.capacity * 3 // 2))
        if self.K is not None:
            L, _, kv, _, hd = self.K.shape
            new = [torch.zeros(L, new_slots, kv, new_cap + 1, hd, dtype=old.dtype) for old in (self.K, self.V)]
            for n, old in zip(new, (self.K, self.V)):
                n[:, :used, :, :self.capacity] = old[:, :used, :, :self.capacity]
            self._set(*new)
        self.lent = self.lent[:used] + [None] * (new_slots - used)
        self.slots, self.capacity = new_slots, new_cap

    @torch.no_grad()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` hold what the first ``length`` columns of slot ``src`` hold (compaction, a
        repeated prompt): its own columns are copied, its lent ones lent again."""
        lent = self.lent[src]
        start = lent.length if lent is not None else 0
        if self.K is not None:
            self.K[:, dst, :, start:length] = self.K[:, src, :, start:length]
            self.V[:, dst, :, start:length] = self.V[:, src, :, start:length]
        self.lent[dst] = lent

    def lend(self, dst: int, keys: Layers, values: Layers, length: int) -> None:
        """Let slot ``dst``'s first ``length`` columns read a stored prefix (per layer (kv_heads, n,
        head_dim), n >= ``length``) without copying it (:meth:`fill` copies it when a pass needs it)."""
        self.lent[dst] = Lent(keys, values, length) if length else None

    def load_prefix(self, dst: int, keys: Layers, values: Layers, length: int, start: int = 0) -> None:
        """Copy stored keys and values (per layer (kv_heads, n, head_dim), n >= ``length - start``) into
        columns ``[start, length)`` of slot ``dst``. With ``start`` 0 the slot then holds all its
        columns (nothing lent); otherwise its first ``start`` columns stay as :meth:`lend` set them."""
        self._copy_in(dst, keys, values, start, length, start)
        if not start:
            self.lent[dst] = None

    @torch.no_grad()
    def _copy_in(self, dst: int, keys: Layers, values: Layers, start: int, stop: int, offset: int) -> None:
        """Columns ``[start, stop)`` of slot ``dst`` from stored ``keys``, ``values`` (their columns
        ``[start - offset, stop - offset)``): one copy for all layers when they are stacked."""
        if start >= stop or not len(keys):
            return
        pk0 = keys[0]
        self._layer(len(keys) - 1, pk0.shape[0], pk0.shape[2], pk0.dtype)
        if isinstance(keys, torch.Tensor):  # (layers, kv_heads, n, head_dim)
            self.K[:len(keys), dst, :, start:stop] = keys[:, :, start - offset:stop - offset]
            self.V[:len(values), dst, :, start:stop] = values[:, :, start - offset:stop - offset]
            return
        for i, (pk, pv) in enumerate(zip(keys, values)):
            self.k[i][dst, :, start:stop] = pk[:, start - offset:stop - offset]
            self.v[i][dst, :, start:stop] = pv[:, start - offset:stop - offset]

    @torch.no_grad()
    def read_prefix(self, src: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of slot ``src``'s first ``length`` columns, (layers, kv_heads, length, head_dim) each
        (lent columns are filled in first)."""
        self.fill(slice(src, src + 1), 0)
        return self.K[:, src, :, :length].clone(), self.V[:, src, :, :length].clone()

    @torch.no_grad()
    def read_row(self, src: int, length: int) -> "Kept":
        """Slot ``src``'s first ``length`` columns as a :class:`Kept`: copies of the columns it holds,
        (layers, kv_heads, length - start, head_dim) each, and the prefix it was lent for the others."""
        lent = self.lent[src]
        start = min(lent.length, length) if lent is not None else 0
        return Kept(self.K[:, src, :, start:length].clone(), self.V[:, src, :, start:length].clone(), length, start,
                    Lent(lent.keys, lent.values, start) if start else None)

    @property
    def nbytes(self) -> int:
        return 0 if self.K is None else self.K.numel() * self.K.element_size() * 2


class PrefixStore:
    """Encoded prefixes for the slot engine: token ids with each layer's keys and values
    (:meth:`SlotCache.read_prefix`), most recently used first, ``entries`` at most (the least
    recently used is dropped). A prefix counts only from ``min_len`` shared tokens on."""

    def __init__(self, entries: int, min_len: int):
        self.entries, self.min_len = entries, min_len
        self.items: list[tuple[tuple[int, ...], Layers, Layers]] = []

    def clear(self) -> None:
        """Forget every prefix (the weights changed)."""
        self.items = []

    def __len__(self) -> int:
        return len(self.items)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(entry index, length) of the longest stored prefix of ``prompt`` (at most len - 1), or (-1, 0)."""
        best, best_n = -1, 0
        for j, (tokens, _, _) in enumerate(self.items):
            n, limit = 0, min(len(tokens), len(prompt) - 1)
            while n < limit and tokens[n] == prompt[n]:
                n += 1
            if n > best_n:
                best, best_n = j, n
        return (best, best_n) if best_n >= self.min_len else (-1, 0)

    def add(self, tokens: list[int], keys: Layers, values: Layers) -> None:
        """Keep ``tokens``' keys and values as the most recently used entry."""
        self.items.insert(0, (tuple(tokens), keys, values))
        del self.items[self.entries:]

    def use(self, j: int) -> tuple[Layers, Layers]:
        """Entry ``j``'s keys and values; it becomes the most recently used."""
        self.items.insert(0, self.items.pop(j))
        return self.items[0][1], self.items[0][2]


class ContinuationStore:
    """The keys and values of finished rows, kept for the request that continues them.

    A multi-turn rollout's next turn is the last one's prompt, its sampled ids, the tool's
    reply and the next turn's header, token for token. A finished row's slot already holds the
    keys and values of its prompt and of every sampled id but the last (the last was sampled,
    never fed back), so keeping them lets the next turn prefill only what was appended. Entries
    are keyed by their exact token ids and looked up by the prompt's prefixes of each stored
    length (a dictionary lookup per length, not a scan); least recently used first out, within
    ``max_bytes``. Vendors call this prefix caching (vLLM's automatic prefix caching, SGLang's
    radix cache); here it is exact-prefix only, one entry per finished row.

    Args:
        max_bytes: the most key/value bytes kept (0: nothing is kept).
        min_len: a match shorter than this many tokens is not used.
    """

    def __init__(self, max_bytes: int, min_len: int):
        self.max_bytes, self.min_len = max_bytes, min_len
        self.items: "OrderedDict[tuple[int, ...], tuple[Kept, int]]" = OrderedDict()  # tokens -> (entry, bytes)
        self.lengths: dict[int, int] = {}  # stored length -> how many entries have it
        self.nbytes = 0
        self.hits = 0  # prompts that continued a stored row
        self.hit_tokens = 0  # prompt tokens those hits did not prefill

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self.items.clear()
        self.lengths.clear()
        self.nbytes = 0

    def add(self, tokens: list[int], kept: Kept) -> None:
        """Keep ``tokens``' keys and values (``kept.length == len(tokens)``; :meth:`SlotCache.read_row`),
        dropping the least recently used entries beyond ``max_bytes``; an entry larger than that is not
        kept. Its size counts the columns it holds (a lent prefix belongs to the prefix store)."""
        if kept.length != len(tokens):
            raise ValueError(f"an entry of {kept.length} columns for {len(tokens)} tokens")
        size = layer_bytes(kept.keys) + layer_bytes(kept.values)
        key = tuple(tokens)
        if size > self.max_bytes or len(key) < self.min_len:
            return
        self._drop(key)
        self.items[key] = (kept, size)
        self.lengths[len(key)] = self.lengths.get(len(key), 0) + 1
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.items)))

    def _drop(self, key: tuple[int, ...]) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.nbytes -= item[1]
            self.lengths[len(key)] -= 1
            if not self.lengths[len(key)]:
                del self.lengths[len(key)]

    def match(self, prompt: list[int]) -> Kept | None:
        """The longest stored entry that is a prefix of ``prompt`` and leaves it at least one token, or
        None; the entry becomes the most recently used."""
        for n in sorted(self.lengths, reverse=True):
            if self.min_len <= n < len(prompt):
                key = tuple(prompt[:n])
                item = self.items.get(key)
                if item is not None:
                    self.items.move_to_end(key)
                    return item[0]
        return None
