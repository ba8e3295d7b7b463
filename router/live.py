"""What the router's live page (/dashboard) draws: time series sampled every second from
the requests it serves, kept for the last ten minutes, in the router's memory."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

HISTORY = 600           # samples (one per second)
SCATTER = 400           # latest (heat, γ) decisions
LATENCY_WINDOW_S = 30.0


@dataclass
class _Window:
    """Counts since the last sample."""

    tokens: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    requests: int = 0


@dataclass
class LiveStats:
    started: float = field(default_factory=time.time)
    series: dict[str, deque] = field(default_factory=dict)
    drafted_at: list[int] = field(default_factory=list)     # per position, since start
    accepted_at: list[int] = field(default_factory=list)
    decisions: deque = field(default_factory=lambda: deque(maxlen=SCATTER))  # (heat, γ)
    _window: _Window = field(default_factory=_Window)
    _ttft: deque = field(default_factory=lambda: deque(maxlen=4096))  # (t, seconds)
    _itl: deque = field(default_factory=lambda: deque(maxlen=16384))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_sample: float = field(default_factory=time.monotonic)

    # -- recording (from request threads) ------------------------------------------------
    def round(self, gamma: int, accepted: int, heat: float) -> None:
        with self._lock:
            w = self._window
            w.rounds += 1
            self.decisions.append((round(heat, 3), gamma))
            if not gamma:
                return
            w.spec_rounds += 1
            w.drafted += gamma
            w.accepted += accepted
            while len(self.drafted_at) < gamma:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            for p in range(gamma):
                self.drafted_at[p] += 1
                self.accepted_at[p] += p < accepted

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append((time.monotonic(), seconds))

    def tokens(self, num_tokens: int, gaps_s: list[float]) -> None:
        """`num_tokens` streamed, with the inter-token gaps they close."""
        with self._lock:
            self._window.tokens += num_tokens
            now = time.monotonic()
            self._itl.extend((now, gap) for gap in gaps_s)

    def request_done(self) -> None:
        with self._lock:
            self._window.requests += 1

    # -- sampling --------------------------------------------------------------------------
    def sample(self) -> None:
        """Close the current window into one point of every series."""
        now = time.monotonic()
        with self._lock:
            w, self._window = self._window, _Window()
            dt, self._last_sample = max(now - self._last_sample, 1e-6), now
            ttft = _recent(self._ttft, now)
            itl = _recent(self._itl, now)
        point = {"t": round(time.time() - self.started, 1),
                 "tokens_per_s": w.tokens / dt, "requests_per_s": w.requests / dt,
                 "acceptance_rate": w.accepted / w.drafted if w.drafted else None,
                 "mean_accepted_len": ((w.accepted + w.spec_rounds) / w.spec_rounds
                                       if w.spec_rounds else None),
                 "mean_gamma": w.drafted / w.rounds if w.rounds else None,
                 "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                 "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99)}
        for name, value in point.items():
            self.series.setdefault(name, deque(maxlen=HISTORY)).append(value)

    def snapshot(self) -> dict:
        with self._lock:
            per_position = [a / d if d else None
                            for a, d in zip(self.accepted_at, self.drafted_at)]
            return {"series": {k: list(v) for k, v in self.series.items()},
                    "per_position_acceptance": per_position,
                    "gamma_vs_heat": list(self.decisions)}

    def run_sampler(self, stop: threading.Event, every_s: float = 1.0) -> threading.Thread:
        def loop() -> None:
            while not stop.wait(every_s):
                self.sample()
        thread = threading.Thread(target=loop, name="live-stats", daemon=True)
        thread.start()
        return thread


def _recent(samples: deque, now: float) -> list[float]:
    return [v for t, v in samples if now - t <= LATENCY_WINDOW_S]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
