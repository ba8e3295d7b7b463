"""Token trees: what a proposer drafts when it drafts more than one candidate per position
(docs/DESIGN.md §8.9), and the rules every tree follows.

A tree is a list of parents, one per node in topological order (a node comes after its
parent); parent -1 is the last committed token. A chain of γ drafts is the tree
[-1, 0, 1, ..., γ-2]: top-k 1. Attention sees a tree through one int64 bitmask per
position, relative to the position itself (bit d: the key d positions back is seen), so a
node sees its ancestors and itself among the 64 positions before it and the context
further back — the same masks serve the target's verification forward and the
proposer's drafting forwards, on the C++ kernel and the reference path.

Verification walks the tree with the target's own choice at each node — its argmax, or
its sample from p at that position's seeded uniform — and follows the child carrying that
token, if there is one. Every node is a point mass (its token, chosen deterministically by
the proposer), and for point-mass drafts that walk is recursive rejection sampling: the
committed tokens are distributed as the target alone would give them, and a seeded
request commits the very tokens the target alone would sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from outrider.core.policy import MASK_BITS
from outrider.engine.goodput import Trials, ewma


@dataclass(frozen=True)
class TreeShape:
    """Top-k children per expanded node and nodes verified per round (EAGLE-2's dynamic
    tree: each level expands the `topk` best nodes by cumulative log-probability, and the
    `tokens` best of every node drafted are verified). top-k 1 is a chain of γ."""

    topk: int = 1
    tokens: int = 0  # 0: every node drafted (at top-k 1: γ)

    def __post_init__(self) -> None:
        if self.topk < 1 or self.tokens < 0:
            raise ValueError("tree top-k must be >= 1 and tree tokens >= 0")
        if self.tokens >= MASK_BITS:
            raise ValueError(f"tree tokens must be below {MASK_BITS}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def within(self, topk: int, tokens: int) -> TreeShape:
        """A request's tree inside this one (top-k 1: a chain; tokens 0: this one's),
        refused where it would verify more: the scheduler reserves this shape's width."""
        shape = TreeShape(topk, tokens or self.tokens)
        if shape.is_chain:
            return shape
        if self.is_chain or shape.topk > self.topk or (self.tokens and not
                                                        0 < shape.tokens <= self.tokens):
            served = ("chains (its --tree-topk is 1)" if self.is_chain else
                      f"trees of top-k {self.topk} and {self.tokens or 'all'} tokens")
            raise ValueError(f"tree_topk {shape.topk}, tree_tokens {shape.tokens}: the "
                             f"replica verifies {served} at most")
        return shape

    def drafted(self, depth: int) -> int:
        """Nodes drafted for a tree `depth` deep: k at the first level, k² after."""
        if depth <= 0:
            return 0
        return depth if self.is_chain else self.topk + (depth - 1) * self.topk ** 2

    def width(self, depth: int) -> int:
        """Nodes verified at γ = `depth`: what a round costs the target's batch."""
        drafted = self.drafted(depth)
        return min(drafted, self.tokens) if self.tokens and not self.is_chain else drafted


class TreeChoice:
    """Whether a step's greedy requests draft trees or chains, by expected goodput. A
    tree round keeps what its own chain (its first children) would have kept plus a
    gain, measured in every tree round against that chain exactly (greedy: the chain's
    tokens are known); it costs its N nodes where the chain verifies γ, priced by the
    replica's cost model (`verify_seconds`), and its levels' k nodes where the chain
    drafts one, measured as draft seconds per drafting row of either kind. The losing
    kind runs now and then (goodput.Trials). Timing each kind's steps
    instead was too noisy (prefill chunks, γ and batch move with every step): trying
    trees on such figures served 0.79-0.89x the chains at 8 streams. Sampled requests
    keep the configured shape (a seed's sample must not depend on timing)."""

    def __init__(self) -> None:
        self.gain: float | None = None   # tokens a tree round keeps over its chain
        self.kept: float | None = None   # drafts a chain round keeps
        self.draft_s: dict[bool, float] = {}  # kind -> draft seconds per drafting row
        self.trials = Trials()

    def observe_round(self, used_tree: bool, kept: int, chain_kept: int) -> None:
        """A greedy round: drafts kept, and what its first children alone kept."""
        self.kept = ewma(self.kept, chain_kept)
        if used_tree:
            self.gain = ewma(self.gain, kept - chain_kept)

    def observe_draft(self, used_tree: bool, rows: int, seconds: float) -> None:
        if rows:
            self.draft_s[used_tree] = ewma(self.draft_s.get(used_tree), seconds / rows)

    def use_tree(self, rows: int, gamma: int, width: int,
                 verify_seconds: Callable[[int], float]) -> bool:
        """For `rows` greedy requests drafting γ deep (a tree: `width` nodes)."""
        if self.gain is None or True not in self.draft_s:
            return True  # measure each kind first
        if False not in self.draft_s:
            return False
        chain_rate = rows * (1 + self.kept) / (
            verify_seconds(rows * (1 + gamma)) + rows * self.draft_s[False])
        tree_rate = rows * (1 + self.kept + self.gain) / (
            verify_seconds(rows * (1 + width)) + rows * self.draft_s[True])
        return self.trials.pick(tree_rate >= chain_rate)


def chain(n: int) -> list[int]:
    """The parents of a chain of n nodes."""
    return list(range(-1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth: 1 for a child of the committed tokens."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def tree_masks(parents: list[int]) -> list[int]:
    """Each node's attention mask: itself, its ancestors, and everything before node 0
    (the context), as bits d = positions back."""
    masks: list[int] = []
    for node, p in enumerate(parents):
        context = ~((1 << (node + 1)) - 1) & ((1 << MASK_BITS) - 1)  # d > node
        bits = 1 | context if p < 0 else 1 | _shifted(masks[p], node - p)
        masks.append(_signed(bits))
    return masks


def _shifted(mask: int, d: int) -> int:
    """A parent's mask seen from a node d positions after it."""
    parent = mask & ((1 << MASK_BITS) - 1)
    # the parent's bit e is the node's bit e + d; the d bits the shift opens at the top
    # are further back than the parent saw: context, seen
    top = ((1 << d) - 1) << (MASK_BITS - d) if d < MASK_BITS else (1 << MASK_BITS) - 1
    return ((parent << d) & ((1 << MASK_BITS) - 1)) | top


def _signed(bits: int) -> int:
    """64 bits as the int64 a tensor holds."""
    return bits - (1 << MASK_BITS) if bits >> (MASK_BITS - 1) else bits


def row_tree(num_fed: int, parents: list[int]) -> tuple[list[int], list[int]]:
    """A verification row's fed tokens (a chain) and the tree drafted after them: each new
    position's offset from the row's first (its RoPE position less the cached length) and
    its attention mask."""
    whole = chain(num_fed) + [num_fed - 1 if p < 0 else num_fed + p for p in parents]
    return [d - 1 for d in depths(whole)], tree_masks(whole)


def first_path(parents: list[int]) -> list[int]:
    """The path down every node's first child: a chain's every node, a tree's best guess."""
    path, at = [], -1
    for node, p in enumerate(parents):
        if p == at:
            path.append(node)
            at = node
    return path


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in order (-1: the committed tokens')."""
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parents):
        children.setdefault(p, []).append(node)
    return children


def walk(parents: list[int], tokens: list[int], choices: list[int]) -> list[int]:
    """The accepted path (node indices, root first): from the committed tokens, follow the
    child whose token is the target's choice at its parent. choices[0] is the target's at
    the last committed token, choices[n + 1] at node n."""
    children = children_of(parents)
    path, at = [], -1
    while True:
        want = choices[at + 1]
        at = next((c for c in children.get(at, ()) if tokens[c] == want), None)
        if at is None:
            return path
        path.append(at)
