"""A torch.distributed pair channel for dense q between a co-located target (rank 0,
which hosts the rendezvous store) and draft (rank 1): gloo on CPU.

The pair is its own process group (not the default one), so it lives beside a target's
tensor-parallel group. Both sides join in the background: a server starts serving gRPC
at once and uses the channel when `is_ready`.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

TARGET_RANK, DRAFT_RANK = 0, 1


class DenseChannel:
    def __init__(self, address: str, rank: int, timeout_s: float = 60.0) -> None:
        host, port = address.rsplit(":", 1)
        self.rank, self.peer = rank, 1 - rank
        self._timeout = timedelta(seconds=timeout_s)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._group = None
        self._is_broken = False
        threading.Thread(target=self._join, args=(host, int(port)), daemon=True,
                         name="dense-channel").start()

    def _join(self, host: str, port: int) -> None:
        try:
            store = dist.TCPStore(host, port, 2, self.rank == TARGET_RANK,
                                  timeout=self._timeout)
            self._group = dist.ProcessGroupGloo(store, self.rank, 2, self._timeout)
            self._store = store  # the group needs its store alive
        except BaseException as exc:  # reported by wait_ready / is_ready
            self._error = exc
        finally:
            self._ready.set()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._is_broken

    def mark_broken(self) -> None:
        """A send or receive went unmatched: the pair cannot tell messages apart any more;
        callers fall back to gRPC for good."""
        self._is_broken = True

    def wait_ready(self, timeout_s: float) -> bool:
        self._ready.wait(timeout_s)
        return self.is_ready

    def send(self, rows: torch.Tensor, tag: int):
        """Post a send of [num_rows, vocab] as fp32. Returns (work, buffer): keep the
        buffer alive until the work is done."""
        buffer = rows.float().contiguous()
        return self._group.send([buffer], self.peer, tag), buffer

    def recv(self, num_rows: int, vocab: int, tag: int) -> torch.Tensor:
        rows = torch.empty(num_rows, vocab)
        self._group.recv([rows], self.peer, tag).wait()
        return rows
