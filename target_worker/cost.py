"""The γ policy's cost model, measured on this replica at start-up (docs/DESIGN.md §4): target
forward time against batch tokens (a flat base up to a knee, then a slope), and the
draft's time per drafted position and round trip, through whatever drafter the replica
uses (in process, or draft replicas over gRPC)."""

from __future__ import annotations

import time

import torch

from outrider.core.policy import CostModel
from outrider.core.sampling import SamplingParams
from outrider.engine.proposer import DraftItem
from outrider.engine.runner import ForwardRequest, ModelRunner

SCRATCH = "cost-calibration"
MIN_DRAFT_SHARE = 0.25  # of a γ = 4 Propose's time per position, at the least
WIDE = 8                # sequences in the batched calibration Propose


def measure_cost_model(target: ModelRunner, drafter, max_batch_tokens: int,
                       repeats: int = 6) -> CostModel:
    # each 5-token row takes a KV block: measure only what the cache holds
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)
             if n <= max_batch_tokens and n // 5 < target.blocks.num_free_blocks]
    top, mid = sizes[-1], sizes[max(0, len(sizes) - 2)]  # the slope's two ends, and 1
    times = {n: _verify_seconds(target, n, repeats) for n in sorted({1, mid, top})}
    base = times[1]
    slope = max(0.0, (times[top] - times[mid]) / (top - mid)) if top > mid else 0.0
    knee = int(max(0, min(top, top - (times[top] - base) / slope))) if slope else top
    per_position, per_token, rtt = (_draft_seconds(drafter, target.device, repeats,
                                                   target.model_config.hidden_size)
                                    if drafter else (0, 0, 0))
    return CostModel(verify_base_s=base, verify_per_token_s=slope, knee_tokens=knee,
                     draft_per_position_s=per_position, draft_rtt_s=rtt,
                     draft_per_token_s=per_token)


def _verify_seconds(runner: ModelRunner, num_tokens: int, repeats: int) -> float:
    """Best time of a forward over `num_tokens` positions in 1+4-token rows (the shape
    of decode rounds with γ = 4), the cache empty."""
    row = min(5, num_tokens)
    ids = [(SCRATCH, k) for k in range(num_tokens // row)]
    blocks = runner.blocks
    try:
        for seq_id in ids:
            blocks.append(seq_id, row)
        requests = [ForwardRequest([1] * row, 0, blocks.block_table(s), row) for s in ids]
        return _best_seconds(lambda: runner.forward(requests), repeats)
    finally:
        for seq_id in ids:
            blocks.free(seq_id)


def _draft_seconds(drafter, device, repeats: int,
                   hidden: int) -> tuple[float, float, float]:
    """(seconds per drafting position, per drafted token, fixed seconds per Propose) from
    one sequence at γ = 1 and γ = 4 and WIDE sequences at γ = 4. At one sequence the
    time is rtt + γ (position + token); the wide batch adds (WIDE - 1) γ tokens."""
    tap = drafter.reads_target  # a head drafts from the target's features: zeros here
    features = torch.zeros(16, tap.width(hidden), device=device) if tap is not None else None

    def propose(num_seqs: int, gamma: int) -> float:
        items = [DraftItem((SCRATCH, k), 0, [1] * 16, gamma, SamplingParams(), seed=0,
                           features=features) for k in range(num_seqs)]
        return _best_seconds(lambda: drafter.draft(items, device), repeats)

    try:
        one, four, wide = propose(1, 1), propose(1, 4), propose(WIDE, 4)
    finally:
        for k in range(WIDE):
            drafter.release((SCRATCH, k))
    per_token = max(0.0, (wide - four) / (4 * (WIDE - 1)))
    # drafting is never free: noise must not make the policy think so
    per_position = max((four - one) / 3 - per_token, MIN_DRAFT_SHARE * four / 4)
    return per_position, per_token, max(0.0, one - per_position - per_token)


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up: on a shared machine the others
    measure the neighbours, not the work (a median let a busy start-up switch
    speculation off for good)."""
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)
