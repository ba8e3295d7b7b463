"""Self-speculation by layer skipping (docs/DESIGN.md §2.10): the target's own layers
draft, some of them skipped (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2025),
so a model with no draft and no head still has a draft model.

The draft is the target's model through a subset of its layers: the same modules, no
copy of a weight (`SkipModel`), run by a runner of its own (`LayerSkipRunner`) behind
the one Proposer (a Drafter), so it drafts chains and trees, samples, misses and
releases as any draft model. Its KV cache holds the kept layers only, its context
computed on the skip path (a share of the target's budget: kept / all layers); verification
is the target's own, so the output is the target's whatever the draft proposes.

Which layers (`choose_layers`, "auto"): measured per checkpoint, SWIFT-style without
training. The target samples a calibration text from itself; a greedy search drops, one
at a time, the layer whose removal keeps the most acceptance, scoring every subset by
the speed-up its per-position acceptance α and cost c (its share of the weights a decode
reads) promise at the best γ; the best subset seen wins. Acceptance is measured both
ways — greedy (the draft's argmax is the target's) and sampled at SAMPLED_T (Σ min(p, q))
— and the sampled one decides, as production traffic is sampled. The choice is kept in
~/.cache/outrider/layer_skip, keyed by the checkpoint, so a restart does not search again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from outrider.core.hf_config import ModelConfigError
from outrider.engine.distill import causal_logits
from outrider.engine.model import CausalLM
from outrider.engine.model_config import ModelConfig
from outrider.engine.runner import ModelRunner, RunnerConfig

log = logging.getLogger(__name__)

LAYER_SKIP_METHOD = "layer_skip"  # its proposals' method in metrics, spans, by_proposer
SAMPLED_T = 0.7  # the temperature whose acceptance chooses the layers
# the calibration text: the target's own samples (temperature 1) from its first token
CALIBRATION_SEQS, CALIBRATION_TOKENS, CALIBRATION_SEED = 4, 96, 0
MAX_GAMMA = 8  # the longest chain a subset is scored at


class SkipModel(nn.Module):
    """The target's model through `kept` of its layers (CausalLM's interface: what the
    runner and distill.causal_logits call). The target's modules are held outside the
    module tree: their weights are the target's, counted, packed and moved there."""

    def __init__(self, target: CausalLM, kept: tuple[int, ...]) -> None:
        super().__init__()
        self.kept = kept
        self.__dict__["target"] = target
        self.__dict__["layers"] = [target.layers[i] for i in kept]
        self.tap = None  # (reads no features)

    # the target's own forward over this interface (kv_caches: the kept layers')
    forward = CausalLM.forward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(input_ids)

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        every = self.target.rotations(positions, dtype)
        return [every[i] for i in self.kept]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.target.norm(x)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.target.logits(normed)


def kept_config(mc: ModelConfig, kept: tuple[int, ...]) -> ModelConfig:
    """The target's config as a model of the `kept` layers alone."""
    return replace(mc, num_layers=len(kept),
                   sliding_windows=tuple(mc.sliding_windows[i] for i in kept),
                   moe_layers=tuple(mc.moe_layers[i] for i in kept) if mc.moe_layers else ())


def check_layers(kept: tuple[int, ...], num_layers: int) -> None:
    if not kept or len(kept) >= num_layers or list(kept) != sorted(set(kept)) \
            or kept[0] < 0 or kept[-1] >= num_layers:
        raise ModelConfigError(
            f"self-draft layers {','.join(map(str, kept)) or '(none)'}: give some of the "
            f"target's {num_layers} layers, fewer than all, in increasing order "
            f"(0..{num_layers - 1}), or 'auto'")


class LayerSkipRunner(ModelRunner):
    """The runner of a SkipModel over `target`'s model: a KV cache of its own for the
    kept layers, on the target's device in its dtype, no compiled forward and no prefix
    caching (its drafts are its own)."""

    method = LAYER_SKIP_METHOD

    def __init__(self, cfg: RunnerConfig, target: ModelRunner, kept: tuple[int, ...]) -> None:
        if target.tp.size > 1:
            raise ModelConfigError("self-speculation (layer skip) needs the target at tp=1: "
                                   "its layers are split over the other ranks' processes")
        check_layers(kept, target.model_config.num_layers)
        self.target, self.kept = target, kept
        super().__init__(replace(cfg, model_dir=target.cfg.model_dir, prefix_caching=False,
                                 compile=False, tp=1, prepared_rows=0,
                                 device=str(target.device), max_model_len=target.max_model_len,
                                 dtype=str(target.dtype).removeprefix("torch.")))

    def read_model_config(self) -> ModelConfig:
        return kept_config(self.target.model_config, self.kept)

    def build_model(self, state: dict[str, torch.Tensor] | None = None) -> SkipModel:
        if state is not None:
            raise ValueError("a layer-skip draft serves the target's weights: nothing to load")
        return SkipModel(self.target.model, self.kept)

    def served(self, model: nn.Module) -> nn.Module:
        return model  # (the target's modules, already served)

    @property
    def model_name(self) -> str:
        return f"{self.target.model_name}[layers {','.join(map(str, self.kept))}]"


def layer_skip_proposer(cfg: RunnerConfig, target: ModelRunner, layers: str):
    """The Drafter over the target's `layers` ("auto": chosen by choose_layers, cached),
    its KV cache the share of the target's that holds as many positions."""
    from outrider.engine.drafter import Drafter

    kept = (cached_choice(target).kept if layers == "auto"
            else parse_layers(layers, target.model_config.num_layers))
    share = len(kept) / target.model_config.num_layers
    runner = LayerSkipRunner(replace(cfg, kv_cache_mb=target.kv_cache_mb * share,
                                     memory_utilization=None), target, kept)
    log.info("%s drafts (self-speculation)", runner.model_name)
    return Drafter(runner)


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    try:
        kept = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ModelConfigError(f"self-draft layers {text!r}: comma-separated layer "
                               f"numbers or 'auto'") from None
    check_layers(kept, num_layers)
    return kept


# -- choosing the layers ---------------------------------------------------------------------
@dataclass(frozen=True)
class SkipChoice:
    """A subset of the target's layers as a draft, as measured."""

    kept: tuple[int, ...]
    cost: float            # c: its share of the weights a decode step reads
    greedy_alpha: float    # P(its argmax is the target's), per position
    sampled_alpha: float   # Σ min(p, q) at SAMPLED_T, per position
    speedup: float         # promised at the best γ (iid acceptance, verification ≈ a decode)
    gamma: int

    def as_json(self) -> dict:
        return {"kept": list(self.kept), "cost": round(self.cost, 4),
                "greedy_alpha": round(self.greedy_alpha, 4),
                "sampled_alpha": round(self.sampled_alpha, 4),
                "speedup": round(self.speedup, 4), "gamma": self.gamma}


def promised_speedup(alpha: float, cost: float) -> tuple[float, int]:
    """(tokens a round ÷ the round's time in decode steps, at the best γ): a chain of γ
    keeps (1 - α^(γ+1)) / (1 - α) tokens a round for γ·c + 1 steps (one verification
    taken as long as a decode: small batches, memory-bound)."""
    def at(g: int) -> float:
        kept = g + 1 if alpha >= 1 else (1 - alpha ** (g + 1)) / (1 - alpha)
        return kept / (g * cost + 1)
    best = max(range(1, MAX_GAMMA + 1), key=at)
    return at(best), best


@torch.no_grad()
def calibration_text(model: CausalLM, bos: int) -> torch.Tensor:
    """[CALIBRATION_SEQS, CALIBRATION_TOKENS] the target samples from `bos` (temperature 1,
    seeded): the text it speculates on, whatever its training."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    device = next(iter(model.parameters()), torch.empty(0)).device
    ids = torch.full((CALIBRATION_SEQS, 1), bos, dtype=torch.long, device=device)
    for _ in range(CALIBRATION_TOKENS - 1):
        last = causal_logits(model, ids)[:, -1].softmax(-1).cpu()  # [seqs, vocab]
        ids = torch.cat([ids, torch.multinomial(last, 1, generator=gen).to(device)], 1)
    return ids


@dataclass(frozen=True)
class Reference:
    """The target's own predictions on the calibration text, computed once per search."""

    argmax: torch.Tensor  # [n]
    probs: torch.Tensor   # [n, vocab] at SAMPLED_T

    @classmethod
    def of(cls, logits: torch.Tensor) -> Reference:  # logits: [n, vocab]
        return cls(logits.argmax(-1), (logits / SAMPLED_T).softmax(-1))


@torch.no_grad()
def measure(target: CausalLM, text: torch.Tensor, kept: tuple[int, ...], cost: float,
            reference: Reference) -> SkipChoice:
    """`kept` as a draft against the target's own predictions on `text`."""
    logits = causal_logits(SkipModel(target, kept), text).flatten(0, 1)  # [n, vocab]
    greedy = (logits.argmax(-1) == reference.argmax).float().mean().item()
    q = (logits / SAMPLED_T).softmax(-1)
    sampled = torch.minimum(reference.probs, q).sum(-1).mean().item()
    speedup, gamma = promised_speedup(sampled, cost)
    return SkipChoice(kept, cost, greedy, sampled, speedup, gamma)


def choose_layers(target: ModelRunner) -> tuple[SkipChoice, list[SkipChoice]]:
    """The best subset found (greedy search, each step dropping the layer whose removal
    keeps the most sampled acceptance), and every subset the search kept on its way."""
    model, mc = target.model, target.model_config
    bos = mc.bos_token_id if mc.bos_token_id is not None else 0
    # a line a step: a replica searching before it listens is seen to progress
    def report(what: str) -> None:
        print(f"layer skip search ({mc.num_layers} layers, once per checkpoint): {what}",
              file=sys.stderr, flush=True)

    report("sampling calibration text")
    text = calibration_text(model, bos)
    with torch.no_grad():
        reference = Reference.of(causal_logits(model, text).flatten(0, 1))
    everything = mc.num_params

    def of(kept: tuple[int, ...]) -> SkipChoice:
        return measure(model, text, kept, kept_config(mc, kept).num_params / everything,
                       reference)

    kept, path = tuple(range(mc.num_layers)), []
    while len(kept) > 1:
        step = max((of(kept[:i] + kept[i + 1:]) for i in range(len(kept))),
                   key=lambda c: c.sampled_alpha)
        path.append(step)
        kept = step.kept
        report(f"{len(kept)} kept, sampled α {step.sampled_alpha:.2f}")
    return max(path, key=lambda c: c.speedup), path


def checkpoint_key(model_dir: str) -> str:
    """The checkpoint as its files are now: config, weights' names, sizes and times."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*")):
        if f.suffix in (".json", ".safetensors", ".bin"):
            stat = f.stat()
            h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    return Path(os.environ.get("OUTRIDER_LAYER_SKIP_CACHE",
                               Path.home() / ".cache" / "outrider" / "layer_skip"))


def cached_choice(target: ModelRunner) -> SkipChoice:
    """choose_layers' choice for the target's checkpoint, searched once and kept."""
    path = cache_dir() / f"{checkpoint_key(target.cfg.model_dir)}.json"
    try:
        stored = json.loads(path.read_text())["choice"]
        return SkipChoice(**{**stored, "kept": tuple(stored["kept"])})
    except (OSError, ValueError, KeyError, TypeError):
        pass  # (not searched yet, or written by another version: searched again)
    choice, searched = choose_layers(target)
    print(f"layer skip: kept {list(choice.kept)} of {target.model_config.num_layers} layers "
          f"(sampled α {choice.sampled_alpha:.2f}, c {choice.cost:.2f}, promised "
          f"{choice.speedup:.2f}x), kept in {path}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": target.cfg.model_dir, "choice": choice.as_json(),
                               "searched": [c.as_json() for c in searched]}, indent=1))
    tmp.replace(path)
    return choice
