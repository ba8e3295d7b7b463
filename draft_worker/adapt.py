"""Online distillation on a draft replica (`draft-worker --adapt`, docs/DESIGN.md §8.6).

The sequences the replica drafted for feed a buffer as they are released; a background
thread trains a copy of the draft on it (outrider/engine/distill.py) and, when the copy
predicts the target's tokens better than the serving weights on held-out traffic, the
replica adopts it between two Proposes. Training never holds the forward lock; only the
swap does."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from outrider.engine.distill import DistillConfig, Distiller, TrafficBuffer
from outrider.engine.drafter import Drafter


@dataclass(frozen=True)
class AdaptRound:
    served_tokens: int        # output tokens the buffer had taken in by then
    serving_agreement: float  # held-out top-1 agreement of the serving weights
    trained_agreement: float  # ... and of the trained copy
    adopted: bool
    version: int              # the version serving after the round
    seconds: float


class Adapter:
    def __init__(self, drafter: Drafter, lock: threading.Lock, cfg: DistillConfig,
                 on_round=None) -> None:
        self.drafter, self.lock, self.cfg = drafter, lock, cfg
        self.buffer = TrafficBuffer(cfg)
        self.distiller = Distiller(drafter.runner, cfg)
        self.rounds: list[AdaptRound] = []
        self.served_tokens = 0
        self.is_training = False
        self.on_round = on_round  # called with each AdaptRound (metrics)
        drafter.on_served = self._served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-adapt", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _served(self, token_ids: list[int], prompt_len: int) -> None:
        self.served_tokens += max(0, len(token_ids) - prompt_len)
        self.buffer.add(token_ids, prompt_len)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            if self.buffer.is_ready():
                self.train_round()

    def train_round(self) -> AdaptRound:
        start = time.perf_counter()
        self.is_training = True
        try:
            state, old, new = self.distiller.train_round(self.buffer, self.drafter.runner.model)
            if state is not None:
                with self.lock:
                    self.drafter.adopt(state)
        finally:
            self.is_training = False
        result = AdaptRound(self.served_tokens, old, new, state is not None,
                            self.drafter.version, time.perf_counter() - start)
        self.rounds.append(result)
        if self.on_round is not None:
            self.on_round(result)
        return result
