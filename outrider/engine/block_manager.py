"""KV-cache block accounting with automatic prefix caching. Plain Python, no tensors:
the runner owns the memory, this class decides which fixed-size blocks each sequence's
positions live in, and which blocks sequences share.

Prefix caching (docs/DESIGN.md §8.3). A block is *sealed* once it is full of positions
whose KV is final (committed tokens, never draft tokens). A sealed block is registered
under the key (its parent's content id, its tokens): the dict compares the token tuples,
so a hash collision can never hand out another prefix's KV. A new sequence starts on the
longest chain of registered blocks matching its tokens (`match_prefix`), sharing them by
reference count. A block nobody references stays registered and evictable; it is reused
for new positions, least recently used first, only when no empty block is left. Sealed
blocks are immutable: rolling a sequence back into them is an error, so a block that may
still be rolled back (draft tokens, a partial block) is never shared.
"""

from __future__ import annotations

from collections import OrderedDict

BlockKey = tuple[int, tuple[int, ...]]  # (parent's content id, the block's tokens)
ROOT = 0  # the content id "before the first block"


class OutOfBlocksError(RuntimeError):
    """The KV budget cannot hold the requested positions (the caller may preempt)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._refs = [0] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks  # registered blocks only
        self._content_id = [ROOT] * num_blocks
        self._registered: dict[BlockKey, int] = {}
        # registered blocks nobody references, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._next_content_id = ROOT + 1
        self._tables: dict[object, list[int]] = {}
        self._lens: dict[object, int] = {}
        self._sealed: dict[object, list[int]] = {}  # content ids of each sequence's sealed blocks
        self.num_queried_tokens = 0  # tokens looked up by match_prefix
        self.num_hit_tokens = 0      # of which found cached

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks new positions may take: empty ones and cached ones nobody uses."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._registered)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def has(self, seq_id) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id) -> int:
        return self._lens[seq_id]

    def sealed_len(self, seq_id) -> int:
        """Positions of `seq_id` in sealed blocks: it may not roll back below this."""
        return len(self._sealed.get(seq_id, ())) * self.block_size

    def block_table(self, seq_id) -> list[int]:
        return self._tables[seq_id]

    def num_exclusive_blocks(self, seq_id) -> int:
        """Blocks freeing `seq_id` would give back (those no other sequence holds)."""
        return sum(self._refs[b] == 1 for b in self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id, num_new: int) -> int:
        """Blocks that appending `num_new` positions to `seq_id` (new or not) would take."""
        length = self._lens.get(seq_id, 0)
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-(length + num_new) // self.block_size) - have)

    def can_append(self, seq_id, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= self.num_free_blocks

    # -- updates ---------------------------------------------------------------------------
    def match_prefix(self, seq_id, token_ids: list[int]) -> int:
        """Start a sequence on the longest cached prefix of `token_ids`; returns the
        positions it holds. A sequence that holds only cached blocks so far (one waiting
        for room) may ask again: blocks sealed meanwhile extend its match. The last token
        is never taken from the cache: its forward gives the logits the sequence goes on
        from."""
        is_new = seq_id not in self._tables
        if not is_new and self._lens[seq_id] != self.sealed_len(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds KV of its own")
        table = self._tables.setdefault(seq_id, [])
        sealed = self._sealed.setdefault(seq_id, [])
        size, already = self.block_size, len(table) * self.block_size
        for block in self._matching(token_ids, sealed[-1] if sealed else ROOT, len(table)):
            self._evictable.pop(block, None)
            self._refs[block] += 1
            table.append(block)
            sealed.append(self._content_id[block])
        self._lens[seq_id] = len(table) * size
        self.num_queried_tokens += len(token_ids) if is_new else 0
        self.num_hit_tokens += len(table) * size - already
        return len(table) * size

    def cached_len(self, token_ids: list[int]) -> int:
        """Positions match_prefix would find cached now (a lookup: nothing is held)."""
        return sum(1 for _ in self._matching(token_ids, ROOT, 0)) * self.block_size

    def _matching(self, token_ids: list[int], parent: int, first: int):
        """The registered blocks that hold `token_ids` from block `first` on, after the
        content `parent`, up to (not including) the block of the last token."""
        size = self.block_size
        end = (len(token_ids) - 1) // size * size if self.prefix_caching else 0
        for start in range(first * size, end, size):
            block = self._registered.get((parent, tuple(token_ids[start:start + size])))
            if block is None:
                return
            yield block
            parent = self._content_id[block]

    def seal(self, seq_id, token_ids: list[int], num_final: int) -> None:
        """The first `num_final` positions of `seq_id` hold the final KV of `token_ids`:
        register the blocks they fill. A block whose content is already registered (two
        sequences computed it at once) stays private; its sequence goes on from the
        registered one's content id, so its later blocks are found all the same."""
        if not self.prefix_caching:
            return
        table, sealed, size = self._tables[seq_id], self._sealed[seq_id], self.block_size
        for index in range(len(sealed), min(num_final, self._lens[seq_id]) // size):
            parent = sealed[-1] if sealed else ROOT
            key = (parent, tuple(token_ids[index * size:(index + 1) * size]))
            known = self._registered.get(key)
            if known is None:
                block = table[index]
                self._registered[key] = block
                self._key_of[block] = key
                self._content_id[block] = known_id = self._next_content_id
                self._next_content_id += 1
            else:
                known_id = self._content_id[known]
            sealed.append(known_id)

    def append(self, seq_id, num_new: int) -> None:
        """Reserve `num_new` more positions for `seq_id`, registering it if new."""
        if num_new < 0:
            raise ValueError("num_new must be >= 0")
        needed = self.blocks_needed(seq_id, num_new)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {needed} KV blocks, {self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        self._sealed.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(needed))
        self._lens[seq_id] = self._lens.get(seq_id, 0) + num_new

    def rollback(self, seq_id, new_len: int) -> None:
        """Forget positions >= new_len; blocks that hold none of the kept ones are freed."""
        if not self.sealed_len(seq_id) <= new_len <= self._lens[seq_id]:
            raise ValueError(f"cannot roll {seq_id!r} back to {new_len} (length "
                             f"{self._lens[seq_id]}, sealed {self.sealed_len(seq_id)})")
        table = self._tables[seq_id]
        keep = -(-new_len // self.block_size)
        for block in reversed(table[keep:]):
            self._release(block)
        del table[keep:]
        self._lens[seq_id] = new_len

    def free(self, seq_id) -> None:
        """Drop the sequence. Its sealed blocks stay cached; the deepest are evicted first."""
        if seq_id in self._tables:
            for block in reversed(self._tables.pop(seq_id)):
                self._release(block)
            del self._lens[seq_id], self._sealed[seq_id]

    def rename(self, seq_id, new_id) -> None:
        """`seq_id`'s blocks become `new_id`'s, which must hold none (a stand-in the
        speculation cache drafted becomes the sequence it stood in for)."""
        if new_id in self._tables:
            raise ValueError(f"sequence {new_id!r} already holds KV")
        for table in (self._tables, self._lens, self._sealed):
            table[new_id] = table.pop(seq_id)

    def forget_cached(self) -> None:
        """Unregister every cached block (their KV was computed with weights that are
        gone): held ones stay with their sequences, unreferenced ones become empty."""
        for block in self._evictable:
            self._empty.append(block)
        self._evictable.clear()
        for block in self._registered.values():
            self._key_of[block] = None
        self._registered.clear()

    def _take(self) -> int:
        if self._empty:
            block = self._empty.pop()
        else:  # reuse the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._registered[self._key_of[block]]
            self._key_of[block] = None
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if self._key_of[block] is None:
            self._empty.append(block)
        else:
            self._evictable[block] = None
