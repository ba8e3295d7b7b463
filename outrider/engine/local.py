"""A target (tensor-parallel group) and an optional draft (a draft model, or a head
that reads the target's hidden states) in this process, with the
tokenizer: what `outrider generate --local` and the tests drive."""

from __future__ import annotations

from dataclasses import dataclass, replace

from outrider.core.hf_config import head_kind
from outrider.core.sequence import NGRAM_SIZES, ProposerKind
from outrider.core.tokenizer import Tokenizer
from outrider.engine.cross_vocab import across_vocabularies
from outrider.engine.distributed import TPRunnerGroup
from outrider.engine.drafter import Drafter
from outrider.engine.heads import head_proposer
from outrider.engine.mix import ProposerMix
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.engine.tree import TreeShape
from outrider.flags import check_self_draft


@dataclass(frozen=True)
class LocalEngineConfig:
    target: RunnerConfig
    draft_dir: str | None = None
    draft_kv_cache_mb: float | None = 64.0  # None: sized from memory (RunnerConfig)
    proposer: str = "auto"  # ProposerKind: what proposes (no draft_dir: only the lookups)
    tree: TreeShape | None = None  # draft token trees of this shape (None: chains)
    # self-speculation: the target's own layers draft ("auto" or "0,1,5"; layer_skip.py)
    self_draft_layers: str | None = None
    ngram_sizes: tuple[int, int] = NGRAM_SIZES  # the n-gram lookup's matches

    def __post_init__(self) -> None:
        check_self_draft(self.self_draft_layers, "--draft", self.draft_dir)


class LocalEngine:
    def __init__(self, cfg: LocalEngineConfig) -> None:
        self.tokenizer = Tokenizer(cfg.target.model_dir)
        is_head = cfg.draft_dir is not None and head_kind(cfg.draft_dir) is not None
        self._target_group = TPRunnerGroup(cfg.target)
        target = self._target_group.runner
        draft = None
        if cfg.draft_dir is not None:
            draft_cfg = replace(cfg.target, model_dir=cfg.draft_dir, tp=1,
                                kv_cache_mb=cfg.draft_kv_cache_mb,
                                quantization=None)  # (--quantization is the target's)
            draft = (head_proposer(draft_cfg, target) if is_head
                     else across_vocabularies(Drafter(ModelRunner(draft_cfg)),
                                              cfg.target.model_dir, cfg.draft_dir,
                                              target.vocab_size))
        elif cfg.self_draft_layers:
            from outrider.engine.layer_skip import layer_skip_proposer

            draft = layer_skip_proposer(cfg.target, target, cfg.self_draft_layers)
        self.decoder = SpeculativeDecoder(target, ProposerMix(
            draft, target.vocab_size, ProposerKind.parse(cfg.proposer, "proposer"),
            ngram_sizes=cfg.ngram_sizes),
            tree=cfg.tree if draft is not None else None)

    def close(self) -> None:
        self._target_group.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
