"""KV-cache block accounting. Plain Python, no tensors: the runner owns the memory,
this class decides which fixed-size blocks each sequence's positions live in."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The KV budget cannot hold the requested positions (the caller may preempt)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._tables: dict[object, list[int]] = {}
        self._lens: dict[object, int] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def has(self, seq_id) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id) -> int:
        return self._lens[seq_id]

    def block_table(self, seq_id) -> list[int]:
        return self._tables[seq_id]

    def blocks_needed(self, seq_id, num_new: int) -> int:
        """Blocks that appending `num_new` positions to `seq_id` (new or not) would take."""
        length = self._lens.get(seq_id, 0)
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-(length + num_new) // self.block_size) - have)

    def can_append(self, seq_id, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= len(self._free)

    # -- updates ---------------------------------------------------------------------------
    def append(self, seq_id, num_new: int) -> None:
        """Reserve `num_new` more positions for `seq_id`, registering it if new."""
        if num_new < 0:
            raise ValueError("num_new must be >= 0")
        needed = self.blocks_needed(seq_id, num_new)
        if needed > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {needed} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(needed))
        self._lens[seq_id] = self._lens.get(seq_id, 0) + num_new

    def rollback(self, seq_id, new_len: int) -> None:
        """Forget positions >= new_len; blocks that hold none of the kept ones are freed."""
        if not 0 <= new_len <= self._lens[seq_id]:
            raise ValueError(f"cannot roll {seq_id!r} back to {new_len} "
                             f"(length {self._lens[seq_id]})")
        table = self._tables[seq_id]
        keep = -(-new_len // self.block_size)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lens[seq_id] = new_len

    def free(self, seq_id) -> None:
        if seq_id in self._tables:
            self._free.extend(reversed(self._tables.pop(seq_id)))
            del self._lens[seq_id]
