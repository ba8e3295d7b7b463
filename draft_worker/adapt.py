"""Online distillation on a draft replica (`draft-worker --adapt`, docs/DESIGN.md §8.6).

The sequences the replica drafted for feed a buffer as they are released; a background
thread trains a copy of the draft on it (outrider/engine/distill.py) and, when the copy
predicts the target's tokens better than the serving weights on held-out traffic, the
replica adopts it between two Proposes. Training never holds the forward lock; only the
swap does. A version whose live acceptance then falls short of its predecessor's is
rolled back.

With `shared` (draft_worker/versions.py) one replica of the pair trains and publishes
its versions; the others pull them."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from outrider.draft_worker.versions import SharedVersions

from outrider.engine.distill import DistillConfig, Distiller, TrafficBuffer
from outrider.engine.drafter import Drafter
from outrider.state import StoreUnavailable

POLL_S = 0.5  # how often the loop checks the buffer, the lease and the version index


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
                 on_round=None, shared: SharedVersions | None = None,
                 on_rollback=None) -> None:
        self.drafter, self.lock, self.cfg, self.shared = drafter, lock, cfg, shared
        self.buffer = TrafficBuffer(cfg)
        self.distiller = Distiller(drafter.runner, cfg)
        self.rounds: list[AdaptRound] = []
        self.served_tokens = 0
        self.is_training = False
        self.is_trainer = False  # with shared versions: while holding the lease
        self.num_rollbacks = 0
        self.state: dict | None = None    # the weights serving (None: the checkpoint's)
        self._on_trial: tuple[int, dict | None] | None = None  # (version, weights before)
        self.on_round = on_round          # called with each AdaptRound (metrics)
        self.on_rollback = on_rollback
        drafter.on_served = self._served
        self._set_trainer(shared is None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-adapt", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _served(self, token_ids: list[int], prompt_len: int, teacher: dict | None = None) -> None:
        self.served_tokens += max(0, len(token_ids) - prompt_len)
        self.buffer.add(token_ids, prompt_len, teacher)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            # without Redis: keep serving the weights we have, try again next tick
            with contextlib.suppress(StoreUnavailable):
                self.tick()

    def tick(self) -> None:
        """One pass of the loop: follow the pair's versions, judge the version on trial,
        train a round when the buffer has enough new traffic."""
        if self.shared is not None:
            self._follow()
        if not self.is_trainer:
            return
        self._judge_trial()
        if self.buffer.is_ready():
            self.train_round()

    def _follow(self) -> None:
        """Pull a newer published version; take over training when the lease is free."""
        latest = self.shared.latest()
        if latest > self.drafter.version:
            state = self.shared.fetch(latest)
            if state is not None:
                self._adopt(state, latest)
        was_trainer = self.is_trainer
        self._set_trainer(self.shared.hold_lease())
        if self.is_trainer and not was_trainer:  # train on from the weights serving
            self.distiller.restart(self.state)
            self._on_trial = None

    def _set_trainer(self, is_trainer: bool) -> None:
        """Only the trainer asks the target for its top-k."""
        self.is_trainer = is_trainer
        self.drafter.target_topk = self.cfg.target_topk if is_trainer else 0

    def train_round(self) -> AdaptRound:
        start = time.perf_counter()
        self.is_training = True
        try:
            verdict = self.distiller.train_round(self.buffer, self.drafter.runner.model,
                                                 tick=self._renew)
            adopted = verdict.weights is not None and self.adopt(verdict.weights)
            if not adopted and verdict.is_astray:
                self.distiller.restart(self.state)
        finally:
            self.is_training = False
        result = AdaptRound(self.served_tokens, verdict.serving_agreement,
                            verdict.trained_agreement, adopted, self.drafter.version,
                            time.perf_counter() - start)
        self.rounds.append(result)
        if self.on_round is not None:
            self.on_round(result)
        return result

    def _renew(self) -> None:
        """Between training steps: keep the lease (a long round must not lose it)."""
        if self.shared is not None:
            with contextlib.suppress(StoreUnavailable):
                self.shared.hold_lease()

    def adopt(self, state: dict) -> bool:
        """Serve trained weights as the next version, on trial until `_judge_trial`
        has seen enough of it; False when another replica now trains."""
        previous = self.state
        if not self._publish(state):
            return False
        self._on_trial = (self.drafter.version, previous)
        return True

    def _publish(self, state: dict) -> bool:
        """Serve `state` as the next version, published first when shared; False when the
        lease went to another replica meanwhile (its versions rule)."""
        version = None
        if self.shared is not None:
            version = self.shared.publish(state)
            if version is None:
                self._set_trainer(False)
                return False
        self._adopt(state, version)
        return True

    def _adopt(self, state: dict, version: int | None) -> None:
        with self.lock:
            self.drafter.adopt(state, version)
        self.state = state

    def _judge_trial(self) -> None:
        """Roll the newest version back once it has drafted `rollback_tokens` live and
        accepts `rollback_margin` less than the version before it did."""
        if self._on_trial is None:
            return
        version, before = self._on_trial
        if version != self.drafter.version:
            self._on_trial = None
            return
        with self.lock:  # the serving thread counts into it
            live = {v: tuple(counts) for v, counts in self.drafter.live_acceptance.items()}
        drafted, accepted = live.get(version, (0, 0))
        if drafted < self.cfg.rollback_tokens:
            return  # not judged yet
        self._on_trial = None
        earlier = [v for v in live if v < version and live[v][0]]
        if not earlier:
            return
        past_drafted, past_accepted = live[max(earlier)]
        if accepted / drafted < past_accepted / past_drafted - self.cfg.rollback_margin:
            self._roll_back(before)

    def _roll_back(self, before: dict | None) -> None:
        state = before if before is not None else self.drafter.runner.build_model().state_dict()
        if self._publish(state):
            self.num_rollbacks += 1
            self.distiller.restart(state)
            if self.on_rollback is not None:
                self.on_rollback()
