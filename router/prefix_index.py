"""What each target replica's prefix cache probably holds: the router's own record of
the token prefixes it sent where, in the replica's KV blocks (docs/DESIGN.md §4.5).

It is an estimate, used only to choose a replica: a replica may have evicted a prefix,
or hold one another router sent it. A block is named by a hash of its tokens and of the
blocks before it; a collision costs a worse choice, never a wrong token (the replica
compares tokens). Each replica's record holds at most as many blocks as its KV cache,
least recently used out first, as the replica evicts."""

from __future__ import annotations

import threading
from collections import OrderedDict


def block_chain(token_ids: list[int], block_size: int) -> list[int]:
    """One name per full block of `token_ids`, each covering the whole prefix up to it."""
    names, name = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        name = hash((name, tuple(token_ids[start:start + block_size])))
        names.append(name)
    return names


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._lock = threading.Lock()

    def num_cached_blocks(self, address: str, chain: list[int]) -> int:
        """Leading blocks of `chain` the replica was last sent."""
        with self._lock:
            blocks = self._blocks.get(address, {})
            return next((i for i, name in enumerate(chain) if name not in blocks), len(chain))

    def add(self, address: str, chain: list[int], capacity: int) -> None:
        """The replica now holds `chain`; it keeps at most `capacity` blocks."""
        with self._lock:
            blocks = self._blocks.setdefault(address, OrderedDict())
            for name in reversed(chain):  # the first blocks most recent, as the replica frees
                blocks[name] = None
                blocks.move_to_end(name)
            while len(blocks) > max(1, capacity):
                blocks.popitem(last=False)

    def forget(self, address: str) -> None:
        """The replica restarted or left: its cache is gone."""
        with self._lock:
            self._blocks.pop(address, None)
