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

from dataclasses import dataclass

MASK_BITS = 64  # positions a tree mask spans


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
    """Whether a step's greedy requests draft trees or chains: the kind whose recent steps
    committed more tokens a second at this many drafting requests (in classes 1, 2-3,
    4-7, ...); the other kind runs now and then so its figure follows the load and the
    text: after 8 steps, and after twice as many (up to 128) each time it loses again. A
    tree costs a level's k nodes and the N verified where a chain costs one each, and
    only pays where the chain's drafts are often rejected: measured, always-on trees
    served 0.80x the chain's tokens a second at 8 streams, and trying them every 8 steps
    0.89x. Sampled requests keep the configured shape (a seed's sample must not depend
    on timing)."""

    FIRST_TRY, LAST_TRY = 8, 128  # steps between tries of the losing kind

    def __init__(self, weight: float = 0.25) -> None:
        self.weight = weight
        # (class, tree) -> decayed (tokens, seconds): a rate of sums, not a mean of
        # per-step rates (a step commits 1 token or 7)
        self.sums: dict[tuple[int, bool], tuple[float, float]] = {}
        self.waits: dict[int, list] = {}  # class -> [steps to the next try, that wait, leader]

    def use_tree(self, drafting: int) -> bool:
        size = drafting.bit_length()
        tree, chain_rate = (self.rate(drafting, kind) for kind in (True, False))
        if tree is None or chain_rate is None:
            return tree is None  # each kind measured once first
        best = tree >= chain_rate
        wait = self.waits.setdefault(size, [self.FIRST_TRY, self.FIRST_TRY, best])
        if wait[2] != best:  # the lead changed: try the other kind soon
            wait[:] = [self.FIRST_TRY, self.FIRST_TRY, best]
        wait[0] -= 1
        if wait[0] > 0:
            return best
        wait[1] = min(2 * wait[1], self.LAST_TRY)  # (it lost again, or the lead changes)
        wait[0] = wait[1]
        return not best

    def rate(self, drafting: int, tree: bool) -> float | None:
        """Tokens a second of recent steps of that kind (None: none yet)."""
        sums = self.sums.get((drafting.bit_length(), tree))
        return None if sums is None else sums[0] / sums[1]

    def observe(self, drafting: int, used_tree: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key, keep = (drafting.bit_length(), used_tree), 1 - self.weight
        old_tokens, old_seconds = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (keep * old_tokens + tokens, keep * old_seconds + seconds)


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


def walk(parents: list[int], tokens: list[int], choices: list[int]) -> list[int]:
    """The accepted path (node indices, root first): from the committed tokens, follow the
    child whose token is the target's choice at its parent. choices[0] is the target's at
    the last committed token, choices[n + 1] at node n."""
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parents):
        children.setdefault(p, []).append(node)
    path, at = [], -1
    while True:
        want = choices[at + 1]
        at = next((c for c in children.get(at, ()) if tokens[c] == want), None)
        if at is None:
            return path
        path.append(at)
