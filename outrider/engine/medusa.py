"""Medusa heads as a proposer: K heads on the target's last normed hidden state, head k
proposing the token k + 1 places after the next one, all from one feature — no KV cache,
no chain (docs/DESIGN.md §8.8).

Checkpoints as vLLM loads them (`MedusaModel`; `blocks.{k}.layers.{l}` and
`lm_heads.{k}`) and as the Medusa authors saved them (`medusa_num_heads`,
`medusa_num_layers`; `{k}.{l}.linear` and `{k}.{num_layers}`), a `medusa_heads.` prefix
either way. Each block is x + SiLU(W x + b), repeated num_layers times.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from outrider.core.hf_config import ModelConfigError, head_kind, read_config
from outrider.core.sampling import History
from outrider.engine.checkpoint import tensor_names
from outrider.engine.drafter import Drafter, TreeGrowth, grow_level, growing, tree_rows, with_trees
from outrider.engine.features import FeatureTap
from outrider.engine.model import load_checkpoint
from outrider.engine.parallel import ParallelLMHead, ReplicatedLinear, TPGroup
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal
from outrider.engine.runner import ModelRunner, built_as


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int,
                 bias: bool) -> None:
        super().__init__()
        tp = TPGroup()
        self.blocks = nn.ModuleList(
            nn.ModuleList(ReplicatedLinear(hidden, hidden, bias, tp) for _ in range(num_layers))
            for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(ParallelLMHead(vocab, hidden, tp)
                                      for _ in range(num_heads))

    def forward(self, head: int, feature: torch.Tensor) -> torch.Tensor:
        # feature: [rows, hidden] -> logits [rows, vocab] of head `head`
        x = feature
        for layer in self.blocks[head]:
            x = x + nn.functional.silu(layer(x))
        return self.lm_heads[head](x).float()


class MedusaProposer:
    """Medusa heads in the target's process (a Proposer). It keeps each sequence's tokens
    only for the sampling processors that read the history; a drafted token's q is its
    head's distribution, whatever was drafted before it."""

    def takes_guesses(self, kind: str) -> bool:
        return False  # (no lookahead)

    def __init__(self, model_dir: str, target: ModelRunner) -> None:
        raw = read_config(model_dir)
        if head_kind(model_dir) != "medusa":
            raise ModelConfigError(f"{model_dir}: not a Medusa checkpoint")
        source = str(Path(model_dir) / "config.json")
        self.num_heads = int(raw.get("medusa_num_heads", raw.get("num_heads", 0)))
        num_layers = int(raw.get("medusa_num_layers", raw.get("num_hidden_layers", 1)))
        hidden = int(raw.get("hidden_size", target.model_config.hidden_size))
        if self.num_heads < 1 or hidden != target.model_config.hidden_size:
            raise ModelConfigError(f"{source}: {self.num_heads} heads of width {hidden}; "
                                   f"the target's is {target.model_config.hidden_size}")
        if int(raw.get("truncated_vocab_size") or target.vocab_size) != target.vocab_size:
            raise ModelConfigError(f"{source}: a truncated vocabulary is not supported")
        names = {_our_name(n, num_layers) for n in tensor_names(Path(model_dir))}
        self.target, self.model_dir = target, model_dir
        bias = any(n.endswith(".bias") for n in names)
        self.heads = built_as(target.dtype, target.device, lambda: MedusaHeads(
            self.num_heads, num_layers, hidden, target.vocab_size, bias))
        load_checkpoint(self.heads, Path(model_dir),
                        lambda name: (_our_name(name, num_layers), None))
        self.heads = target.served(self.heads)
        self._tokens: dict[object, tuple[list[int], int]] = {}  # seq -> (tokens, prompt_len)
        self.num_misses = 0

    # -- Proposer ----------------------------------------------------------------------------
    vocab_size = property(lambda self: self.target.vocab_size)
    max_model_len = property(lambda self: self.target.max_model_len)
    model_name = property(lambda self: Path(self.model_dir).name)
    version = 0
    target_topk = 0
    reads_target = FeatureTap(normed=True)
    drafts_trees = True  # level j of a tree from head j (_draft_trees)
    prepares_ahead = False
    method = "medusa"

    def version_of(self, seq_id) -> int:
        return 0

    def release(self, seq_id) -> bool:
        return self._tokens.pop(seq_id, None) is not None

    def submit(self, items: list[DraftItem], device: torch.device | None = None,
               beside_target: bool = False) -> PendingProposal:
        out = self.draft(items, device)
        return PendingProposal(lambda: out)

    @torch.inference_mode()
    def draft(self, items: list[DraftItem], device: torch.device | None = None) -> Proposal:
        device = device or self.target.device
        is_miss = [it.is_active and not self._take(it) for it in items]
        self.num_misses += sum(is_miss)
        gammas = [min(it.gamma, self.num_heads) if it.is_active and not miss and
                  it.features is not None and not it.prefill_only else 0
                  for it, miss in zip(items, is_miss)]
        in_trees, chains = tree_rows(items, gammas)
        proposal = Proposal(*self._draft_chains(items, chains, device), chains, is_miss)
        if in_trees:
            trees = self._draft_trees([items[i] for i in in_trees], [gammas[i] for i in in_trees])
            proposal = with_trees(proposal, in_trees, trees, self.vocab_size, device)
        return proposal

    def _draft_chains(self, items: list[DraftItem], gammas: list[int], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [items, max γ] of the rows whose γ > 0, token j from head j, and
        their q [items, max γ, vocab] where any samples."""
        rows = [i for i, g in enumerate(gammas) if g]
        width = max(gammas, default=0)
        token_ids = torch.zeros(len(items), width, dtype=torch.long, device=device)
        probs = (torch.zeros(len(items), width, self.vocab_size, device=device)
                 if any(not items[i].params.is_greedy for i in rows) else None)
        if rows:
            # the target's feature at the position before the last committed token
            feature = torch.stack([items[i].features[-1] for i in rows]).to(self.target.dtype)
            drafted: list[list[int]] = [[] for _ in rows]
            for j in range(width):
                live = [k for k, i in enumerate(rows) if gammas[i] > j]
                logits = self.heads(j, feature[live])  # [len(live), vocab]
                picked = [items[rows[k]] for k in live]
                histories = ([self._history(items[rows[k]], drafted[k]) for k in live]
                             if any(it.params.reads_history for it in picked) else None)
                tokens, q = Drafter._pick(logits, picked, histories, j)
                for k, token in zip(live, tokens.tolist()):
                    drafted[k].append(token)
                index = torch.tensor([rows[k] for k in live], device=device)
                token_ids[index, j] = tokens.to(device)
                if probs is not None:
                    probs[index, j] = (q.to(device) if q is not None else
                                       nn.functional.one_hot(tokens, self.vocab_size).float())
        return token_ids, probs

    def _draft_trees(self, items: list[DraftItem], gammas: list[int]
                     ) -> list[tuple[list[int], list[int], torch.Tensor | None]]:
        """Each item's token tree (tokens, parents, q), grown and kept as a draft model's
        (TreeGrowth): level j's children come from head j, whatever their parent, since
        every head reads the one feature; the request's processors still see each node's
        own path."""
        grow = {i: TreeGrowth(it) for i, it in enumerate(items)}
        # [items, hidden]: the target's feature at the position before the last committed
        features = torch.stack([it.features[-1] for it in items]).to(self.target.dtype)
        for level in range(max(gammas)):
            rows = growing(grow, gammas, level)
            if not rows:
                break
            logits = self.heads(level, features[rows])  # [rows, vocab]
            expanding = torch.tensor([len(grow[i].expanding()) for i in rows],
                                     device=logits.device)
            grow_level(grow, rows, items, gammas, level,
                       logits.repeat_interleave(expanding, dim=0), None, self._history)
        return [grow[i].tree() for i in range(len(items))]

    def _take(self, item: DraftItem) -> bool:
        """The committed tokens after the prefix the caller believes held; False: a MISS."""
        tokens, _ = self._tokens.get(item.seq_id, ([], 0))
        if item.committed_len > len(tokens) or not item.new_token_ids:
            return False
        self._tokens[item.seq_id] = (tokens[:item.committed_len] + item.new_token_ids,
                                     item.prompt_len)
        return True

    def _history(self, item: DraftItem, drafted: list[int]) -> History:
        tokens, prompt_len = self._tokens[item.seq_id]
        return History(tokens, prompt_len, tuple(drafted), None)


def _our_name(name: str, num_layers: int) -> str:
    """A checkpoint tensor's name in MedusaHeads (vLLM's names, or the authors')."""
    name = name.removeprefix("medusa_heads.").removeprefix("medusa_head.")
    old = re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", name)
    if old is None:
        return name.replace(".layers.", ".")
    head, layer, param = old.groups()
    if int(layer) == num_layers:  # the head's last module is its lm_head
        return f"lm_heads.{head}.{param}"
    return f"blocks.{head}.{layer}.{param}"
