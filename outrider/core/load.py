"""What a target replica tells routers of itself: the engine's side of GetLoad. Torch-free:
the replica's service, its metrics and the Ray controller read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What the replica tells routers of itself (GetLoad; protos: Load)."""

    num_running: int
    num_waiting: int
    heat: float               # demand on this step's token budget (§4)
    kv_used_blocks: int
    kv_total_blocks: int
    tokens_per_s: float
    model_pair: str
    max_batch_tokens: int
    block_size: int
    prefix_caching: bool
    queued_tokens: int        # prompt tokens still to compute, cached prefixes not counted


def model_pair(target: str, draft: str = "", version: int = 0) -> str:
    """How a replica names what it serves (`Load.model_pair`): "target+draft@vN", or
    "target" with no draft model. A new draft version is a new pair to the routers'
    acceptance statistics."""
    if not draft:
        return target
    return f"{target}+{draft}" + (f"@v{version}" if version else "")


def pair_target(pair: str) -> str:
    """A model pair's target checkpoint name."""
    return pair.split("+", 1)[0]


def pair_has_draft(pair: str) -> bool:
    return "+" in pair
