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
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from selfrl.engines.sharedattention import SharedPrefix


class SlotCache:
    """Per-layer key/value storage for ``slots`` sequences of up to ``capacity`` positions.

    Tensors are allocated at the first ``update`` of each layer (the key/value head
    count, head size and dtype come from the model's own states).
    """

    def __init__(self, slots: int = 8, capacity: int = 256):
        self.slots, self.capacity = slots, capacity
        self.k: list[torch.Tensor] = []  # per layer (slots, kv_heads, capacity + 1, head_dim)
        self.v: list[torch.Tensor] = []
        self.rows = slice(0, 0)  # the slots the current forward pass runs on
        self.width = 0  # columns visible to attention in the current pass
        self.write_rows: torch.Tensor | None = None  # (b, T) slot of each input token
        self.write_cols: torch.Tensor | None = None  # (b, T) column of each input token
        self.shared: SharedPrefix | None = None  # a prefix all rows of the pass share, attended apart
        self.segments: list | None = None  # a packed pass's segments (selfrl.engines.packedattention.Segment)

    # ------------------------------------------------------------------ the transformers side

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the pass's (b, kv_heads, T, head_dim) states in place; return the window's
        (b, kv_heads, width, head_dim) keys and values (views)."""
        while len(self.k) <= layer_idx:
            self.k.append(torch.zeros(0))
            self.v.append(torch.zeros(0))
        if self.k[layer_idx].dim() != 4:
            shape = (self.slots, key_states.shape[1], self.capacity + 1, key_states.shape[3])
            self.k[layer_idx] = torch.zeros(shape, dtype=key_states.dtype)
            self.v[layer_idx] = torch.zeros(shape, dtype=value_states.dtype)
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[self.write_rows, :, self.write_cols] = key_states.transpose(1, 2)  # (b, T, kv_heads, head_dim)
        v[self.write_rows, :, self.write_cols] = value_states.transpose(1, 2)
        if self.segments is not None:  # a packed pass: each segment's attention takes its own rows and columns
            return k, v
        start = self.shared.length if self.shared is not None else 0  # the shared prefix is attended apart
        return k[self.rows, :, start:self.width], v[self.rows, :, start:self.width]

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

    def set_packed(self, write_rows: torch.Tensor, write_cols: torch.Tensor, segments: list) -> None:
        """Set up a packed forward pass (:mod:`selfrl.engines.packedattention`): its (1, N) tokens are
        written at ``write_rows``, ``write_cols``, and ``update`` hands attention every layer's whole
        tensors, which :func:`~selfrl.engines.packedattention.packed_attention` reads segment by segment."""
        self.write_rows, self.write_cols, self.segments, self.shared = write_rows, write_cols, segments, None
        self.rows, self.width = slice(0, self.slots), max(s.width for s in segments)

    @property
    def scratch(self) -> int:
        """The column padding tokens write to (never inside a window)."""
        return self.capacity

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
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                if old.dim() != 4:
                    continue
                new = torch.zeros(new_slots, old.shape[1], new_cap + 1, old.shape[3], dtype=old.dtype)
                new[:used, :, :self.capacity] = old[:used, :, :self.capacity]
                store[i] = new
        self.slots, self.capacity = new_slots, new_cap

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of slot ``src`` into slot ``dst`` (compaction)."""
        for store in (self.k, self.v):
            for t in store:
                if t.dim() == 4:
                    t[dst, :, :length] = t[src, :, :length]

    def load_prefix(self, dst: int, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Copy a stored prefix (per layer (kv_heads, n, head_dim), n >= ``length``) into
        columns ``[0, length)`` of slot ``dst``."""
        while len(self.k) < len(keys):
            self.k.append(torch.zeros(0))
            self.v.append(torch.zeros(0))
        for i, (pk, pv) in enumerate(zip(keys, values)):
            if self.k[i].dim() != 4:
                shape = (self.slots, pk.shape[0], self.capacity + 1, pk.shape[2])
                self.k[i] = torch.zeros(shape, dtype=pk.dtype)
                self.v[i] = torch.zeros(shape, dtype=pv.dtype)
            self.k[i][dst, :, :length] = pk[:, :length]
            self.v[i][dst, :, :length] = pv[:, :length]

    def read_prefix(self, src: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of slot ``src``'s first ``length`` columns, per layer (kv_heads, length, head_dim)."""
        return ([t[src, :, :length].clone() for t in self.k if t.dim() == 4],
                [t[src, :, :length].clone() for t in self.v if t.dim() == 4])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PrefixStore:
    """Encoded prefixes for the slot engine: token ids with each layer's keys and values
    (:meth:`SlotCache.read_prefix`), most recently used first, ``entries`` at most (the least
    recently used is dropped). A prefix counts only from ``min_len`` shared tokens on."""

    def __init__(self, entries: int, min_len: int):
        self.entries, self.min_len = entries, min_len
        self.items: list[tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]] = []

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

    def add(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep ``tokens``' keys and values as the most recently used entry."""
        self.items.insert(0, (tuple(tokens), keys, values))
        del self.items[self.entries:]

    def use(self, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
        self.items: "OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor], int]]" = OrderedDict()
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

    def add(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep ``tokens``' keys and values (per layer (kv_heads, len(tokens), head_dim)), dropping the
        least recently used entries beyond ``max_bytes``; an entry larger than that is not kept."""
        size = sum(t.numel() * t.element_size() for t in keys + values)
        key = tuple(tokens)
        if size > self.max_bytes or len(key) < self.min_len:
            return
        self._drop(key)
        self.items[key] = (keys, values, size)
        self.lengths[len(key)] = self.lengths.get(len(key), 0) + 1
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.items)))

    def _drop(self, key: tuple[int, ...]) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.nbytes -= item[2]
            self.lengths[len(key)] -= 1
            if not self.lengths[len(key)]:
                del self.lengths[len(key)]

    def match(self, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """(keys, values, length) of the longest stored entry that is a prefix of ``prompt`` and leaves
        it at least one token, or None; the entry becomes the most recently used."""
        for n in sorted(self.lengths, reverse=True):
            if self.min_len <= n < len(prompt):
                key = tuple(prompt[:n])
                item = self.items.get(key)
                if item is not None:
                    self.items.move_to_end(key)
                    return item[0], item[1], n
        return None
