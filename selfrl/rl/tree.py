"""A batch of token sequences as one prefix tree: every shared prefix encoded once.

The sequences of a GRPO batch share far more than their common system prompt. A
group's ``num_generations`` samples share their task's prompt, and once a policy
settles they often share their first tool call, or the whole completion. In the
demo's later updates 64 sequences of about 280 tokens hold some 1,700 distinct
prefixes: the distinct nodes of their prefix tree (a trie).

A causal decoder's hidden state at a position depends only on the tokens up to it, so
one forward pass over the tree's nodes (depth-first, each node attending to itself and
its ancestors, its position id its depth) gives every sequence's hidden states
exactly: the same numbers as the padded batch, up to floating-point summation order.
Gradients are exact too: a node shared by k sequences receives the sum of their
gradients through the gather that reads it. This is the shared-prefix packing of
"tree attention" (Cai et al. 2024, Medusa; and the prefix-tree packing of later
RL trainers), with the attention mask built from the subtree spans of a depth-first
order: node ``j`` is an ancestor-or-self of node ``i`` exactly when ``j <= i < end[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Attention over a packed tree is dense (every node against every node, masked), so a
# large tree costs N^2 attention work; above this many nodes the tree is not used.
MAX_TREE_NODES = 4096


@dataclass
class PrefixTree:
    """The prefix tree of B sequences, nodes in depth-first preorder.

    Attributes:
        token_ids: (N,) long, each node's token.
        position_ids: (N,) long, each node's depth (0 for a first token): its position
            in every sequence that passes through it.
        end: (N,) long, one past the last node of each node's subtree.
        node_of: (B, T) long, the node of sequence b's token t; -1 past its length.
    """

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    end: torch.Tensor
    node_of: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def attention_mask(self) -> torch.Tensor:
        """(1, 1, N, N) bool, True where query node i may attend to key node j: j is i or
        one of its ancestors (``j <= i < end[j]``)."""
        idx = torch.arange(self.num_nodes, device=self.end.device)
        mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < self.end[None, :])  # (N, N)
        return mask[None, None]


def build_tree(rows: list[list[int]], device: torch.device | str | None = None) -> PrefixTree:
    """The :class:`PrefixTree` of ``rows`` (B token-id lists, each non-empty).

    The rows are inserted in lexicographic order, which numbers the nodes in
    depth-first preorder (children in token order), so subtrees are contiguous.

    >>> t = build_tree([[5, 6, 7], [5, 6, 8], [5, 9]])
    >>> t.token_ids.tolist(), t.position_ids.tolist(), t.end.tolist()
    ([5, 6, 7, 8, 9], [0, 1, 2, 2, 1], [5, 4, 3, 4, 5])
    >>> t.node_of.tolist()
    [[0, 1, 2], [0, 1, 3], [0, 4, -1]]

    Raises:
        ValueError: an empty row.
    """
    if any(len(r) == 0 for r in rows):
        raise ValueError("every row needs at least one token")
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    children: list[dict[int, int]] = [{}]  # children[k + 1]: the children of node k; children[0]: the roots
    tokens: list[int] = []
    depth: list[int] = []
    parent: list[int] = []
    T = max((len(r) for r in rows), default=0)
    node_of = torch.full((len(rows), T), -1, dtype=torch.long)  # (B, T)
    for i in order:
        at = -1
        path = []
        for d, tok in enumerate(rows[i]):
            kids = children[at + 1]
            nxt = kids.get(tok)
            if nxt is None:
                nxt = len(tokens)
                kids[tok] = nxt
                tokens.append(tok)
                depth.append(d)
                parent.append(at)
                children.append({})
            path.append(nxt)
            at = nxt
        node_of[i, :len(path)] = torch.tensor(path, dtype=torch.long)
    end = list(range(1, len(tokens) + 1))
    for k in range(len(tokens) - 1, -1, -1):  # a parent precedes its children: their spans are final first
        if parent[k] >= 0 and end[k] > end[parent[k]]:
            end[parent[k]] = end[k]
    return PrefixTree(torch.tensor(tokens, dtype=torch.long, device=device),
                      torch.tensor(depth, dtype=torch.long, device=device),
                      torch.tensor(end, dtype=torch.long, device=device), node_of.to(device))


def tree_pays(num_nodes: int, rows_cost: float, hidden_size: int) -> bool:
    """Whether a packed tree of ``num_nodes`` costs less than ``rows_cost``, the
    token-equivalents of the padded layout (see :func:`layout_cost`).

    A tree's cost is its nodes plus its dense attention, ``N^2 / (6 * hidden_size)``
    token-equivalents: a decoder layer's linear maps cost about ``2 * 12 h^2`` FLOPs a token
    and attention ``4 h`` a query-key pair. None above :data:`MAX_TREE_NODES`.

    >>> tree_pays(300, 1000.0, 576), tree_pays(900, 1000.0, 576), tree_pays(5000, 1e9, 576)
    (True, False, False)
    """
    if num_nodes > MAX_TREE_NODES:
        return False
    return num_nodes + num_nodes * num_nodes / (6 * hidden_size) < rows_cost


def layout_cost(batch: int, length: int, prefix: int, hidden_size: int) -> float:
    """Token-equivalents of encoding B padded rows of T tokens whose first ``prefix``
    tokens are encoded once and shared: ``S + B (T - S)`` tokens plus the attention of
    ``B (T - S)`` queries over ``T`` keys (units as :func:`tree_pays`)."""
    tail = batch * (length - prefix)
    return prefix + tail + tail * length / (6 * hidden_size)
