"""Draft heads that read the target's hidden states: EAGLE-3 and EAGLE-1, loaded from the
checkpoint layouts vLLM, SGLang and SpecForge share (docs/DESIGN.md §8.8); Medusa's heads
are in medusa.py, and `head_proposer` gives the proposer of any of them.

A head is a one-layer model the Drafter runs like a draft model (`HeadRunner` is
its ModelRunner), so a head is one more proposer behind the same contract: its inputs
are the tokens and, with each, the feature of the position before it (features.py) —
the target's for committed tokens, the head's own output for the ones it drafted.

Positions: the head's pair (feature at p, token at p + 1) sits at position p, as in the
EAGLE papers and vLLM, so a sequence of n tokens holds n - 1 pairs. The Drafter counts
tokens; `HeadRunner` maps its requests onto pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from outrider.core.hf_config import HEAD_KINDS, ModelConfigError, head_kind, read_config
from outrider.core.stats import HEAD_METHODS
from outrider.engine.attention import AttentionMetadata
from outrider.engine.checkpoint import tensor_names
from outrider.engine.features import FeatureTap
from outrider.engine.model import (
    MLP,
    Attention,
    CausalLM,
    DecoderLayer,
    RMSNorm,
    fused_param,
    load_checkpoint,
)
from outrider.engine.model_config import ModelConfig
from outrider.engine.parallel import (
    ParallelLMHead,
    ReplicatedLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from outrider.engine.rope import RotaryEmbedding
from outrider.engine.runner import (
    ForwardRequest,
    ModelRunner,
    RunnerConfig,
    built_as,
    context_limit,
    resolve_dtype,
)


@dataclass(frozen=True)
class HeadConfig:
    kind: str
    layer: ModelConfig     # the head's decoder layer (vocab_size: the target's)
    tap: FeatureTap        # what it reads of the target
    draft_vocab_size: int  # its lm_head's rows (d2t maps them to target ids)
    norm_before_residual: bool = False  # EAGLE-3: the normed feature is the residual

    @classmethod
    def from_dir(cls, model_dir: str | Path, target: ModelConfig) -> HeadConfig:
        raw = read_config(model_dir)
        kind = HEAD_KINDS.get((raw.get("architectures") or [None])[0])
        if kind not in ("eagle3", "eagle1"):
            raise ModelConfigError(f"{model_dir}: not an EAGLE head ({', '.join(HEAD_KINDS)})")
        source = str(Path(model_dir) / "config.json")
        layer = ModelConfig.from_hf_dict(
            {**raw, "architectures": ["LlamaForCausalLM"], "vocab_size": target.vocab_size,
             "tie_word_embeddings": False}, source=source)
        if layer.num_layers != 1:
            raise ModelConfigError(f"{source}: num_hidden_layers is {layer.num_layers}; "
                                   f"heads with one layer are supported")
        if kind == "eagle1" and layer.hidden_size != target.hidden_size:
            raise ModelConfigError(f"{source}: hidden_size {layer.hidden_size} differs from "
                                   f"the target's {target.hidden_size}")
        eagle = raw.get("eagle_config") or {}
        if kind == "eagle3" and any(eagle.get(k) or raw.get(k) for k in (
                "norm_before_fc", "fc_norm", "norm_output")):
            raise ModelConfigError(f"{source}: norm_before_fc, fc_norm and norm_output "
                                   f"are not supported")
        return cls(kind, layer, _tap(kind, raw, eagle, target, source),
                   int(raw.get("draft_vocab_size") or target.vocab_size),
                   bool(raw.get("norm_before_residual", False)))

    @property
    def feature_width(self) -> int:
        """What the target keeps a position for it: one hidden vector (EAGLE-3's taps
        fused by its fc, `fused_tap`; EAGLE-1's the target's normed hidden state)."""
        return self.layer.hidden_size

    def fused_tap(self, fc) -> FeatureTap:
        """Its tap with EAGLE-3's fc applied as the target keeps the taps."""
        if self.kind != "eagle3":
            return self.tap
        return replace(self.tap, fuse=fc, fused_width=self.feature_width)


def _tap(kind: str, raw: dict, eagle: dict, target: ModelConfig, source: str) -> FeatureTap:
    """EAGLE-3 reads the residual stream entering three target layers: those its config
    names, else the inputs of layers 2, L/2 and L-3 (vLLM's and SpecForge's default)."""
    if kind == "eagle1":
        return FeatureTap(normed=True)
    if eagle.get("use_aux_hidden_state") is False:
        raise ModelConfigError(f"{source}: use_aux_hidden_state false is not supported")
    n = target.num_layers
    layers = (raw.get("eagle_aux_hidden_state_layer_ids")
              or eagle.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
    layers = tuple(sorted({int(i) for i in layers}))
    if not all(0 <= i <= n for i in layers):
        raise ModelConfigError(f"{source}: eagle_aux_hidden_state_layer_ids {list(layers)} "
                               f"are not layers of a {n}-layer target")
    width = int(raw.get("target_hidden_size") or raw["hidden_size"])
    if width != target.hidden_size:
        raise ModelConfigError(f"{source}: target_hidden_size {width} differs from the "
                               f"target's {target.hidden_size}")
    return FeatureTap(layers=layers)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [normed embedding, normed feature]."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool, tp: TPGroup) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, tp, input_size=2 * hidden)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, cos_sin: tuple,
                kv_cache: tuple, meta: AttentionMetadata) -> torch.Tensor:
        # embeds, feature: [num_tokens, hidden] -> [num_tokens, hidden] before the final norm
        normed = self.hidden_norm(feature)
        residual = (normed if self.norm_before_residual else feature).clone()  # (added
        x = torch.cat([self.input_layernorm(embeds), normed], -1)  # into in place below)
        attended = self.self_attn(x, cos_sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return residual + self.mlp(h)


class DraftHead(nn.Module):
    """A head over flattened ragged pairs; logits over the target's vocabulary for the
    rows asked for, and (`hidden_out`) the hidden state each of them feeds back as the
    feature of the next drafted position."""

    def __init__(self, head: HeadConfig, target_embed: nn.Module, target_lm_head: nn.Module,
                 own: set[str], max_positions: int) -> None:
        super().__init__()
        cfg, tp = head.layer, TPGroup()
        self.kind = head.kind
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                    cfg.rope_scaling)
        self.hidden_out: torch.Tensor | None = None  # [num_rows, hidden], last forward's
        # the target's embedding and lm_head where the checkpoint has none (kept out of
        # this module's parameters: they are the target's)
        self._target = (target_embed, target_lm_head)
        if "embed_tokens.weight" in own:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        if head.kind == "eagle3":
            width = cfg.hidden_size * len(head.tap.layers)
            self.fc = ReplicatedLinear(width, cfg.hidden_size, False, tp)
            self.midlayer = Eagle3Layer(cfg, head.norm_before_residual, tp)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(head.draft_vocab_size, cfg.hidden_size, tp)
        else:
            self.fc = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size,
                                       "fc.bias" in own, tp)
            self.layer = DecoderLayer(cfg, 0, tp, input_norm=False)
            if "lm_head.weight" in own:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if head.draft_vocab_size != cfg.vocab_size:
            # draft id i is target id i + d2t[i]
            self.d2t = nn.Parameter(torch.zeros(head.draft_vocab_size, dtype=torch.long),
                                    requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, logits_rows: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens]; features: [num_tokens, tap width or hidden]
        embed = getattr(self, "embed_tokens", None)
        embeds = torch.nn.functional.embedding(
            input_ids, (embed or self._target[0]).weight)  # [num_tokens, hidden]
        cos_sin = self.rope.lookup(positions, embeds.dtype)
        features = features.to(embeds.device, embeds.dtype)  # (a replica's come on the CPU)
        if self.kind == "eagle3":
            if features.shape[-1] != embeds.shape[-1]:  # the target's taps, not our own
                features = self.fc(features)
            out = self.midlayer(embeds, features, cos_sin, kv_caches[0], meta)
            self.hidden_out = out.index_select(0, logits_rows)
            return self._to_target_vocab(self.lm_head(self.norm(self.hidden_out)).float())
        x = self.fc(torch.cat([embeds, features], -1))
        out = self.layer(x, cos_sin, kv_caches[0], meta)
        self.hidden_out = out.index_select(0, logits_rows)
        lm_head = getattr(self, "lm_head", None) or self._target[1]
        return lm_head(self.hidden_out).float()

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, draft vocab] -> [rows, target vocab]; a target id the head cannot
        propose gets -inf (q = 0 there)."""
        d2t = getattr(self, "d2t", None)
        if d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], self._target[0].vocab_size), float("-inf"))
        full[:, torch.arange(len(d2t), device=d2t.device) + d2t] = logits
        return full

    def load_weights(self, model_dir: Path) -> None:
        load_checkpoint(self, model_dir, self._param_for)

    def _param_for(self, name: str) -> tuple[str, int | None] | None:
        if name == "t2d" or "rotary_emb" in name or (name == "d2t" and not hasattr(self, "d2t")):
            return None  # (a full vocabulary's d2t is the identity)
        name = name.removeprefix("model.")
        if self.kind == "eagle3":
            return fused_param(name)
        return fused_param(name.replace("layers.0.", "layer."))


def head_tensor_names(model_dir: str | Path) -> set[str]:
    """The checkpoint's tensor names, as the head names them (no `model.` prefix)."""
    return {name.removeprefix("model.") for name in tensor_names(Path(model_dir))}


def check_head_names(kind: str, names: set[str], model_dir: str | Path) -> None:
    """A head's checkpoint must hold what its kind reads: a clear error where it lacks
    it (a draft model's checkpoint given a head's config, say)."""
    wanted = {"eagle3": ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"),
              "eagle1": ("fc.weight", "layers.0.self_attn.q_proj.weight")}[kind]
    missing = [w for w in wanted if w not in names]
    if missing:
        raise ModelConfigError(f"{model_dir}: an {kind} head's checkpoint lacks "
                               f"{', '.join(missing)}")


@dataclass(frozen=True)
class TargetSide:
    """What a head takes from the target it drafts for: its config, its embedding and
    lm_head (used where the head has none), its context, device and dtype — the
    target's own in its process (`of_runner`), or loaded from the target's checkpoint
    on a draft replica (`from_checkpoint`: the embedding and lm_head alone)."""

    config: ModelConfig
    embed_tokens: nn.Module
    lm_head: nn.Module
    context: int          # the longest sequence the target serves
    device: str
    dtype: torch.dtype
    tp_size: int = 1      # the target's ranks (a head that shares its embedding needs 1)

    @classmethod
    def of_runner(cls, target: ModelRunner) -> TargetSide:
        """The target beside the head, in its process; the context as far as its cache
        holds it."""
        context = min(target.max_model_len, target.blocks.num_blocks * target.blocks.block_size)
        return cls(target.model_config, target.model.embed_tokens, target.model.lm_head,
                   context, target.cfg.device, target.dtype, target.tp.size)

    @classmethod
    def from_checkpoint(cls, cfg: RunnerConfig) -> TargetSide:
        """The target's embedding and lm_head from its checkpoint (cfg.model_dir), in
        cfg's device and dtype: a head on a draft replica, away from the target."""
        config = ModelConfig.from_dir(cfg.model_dir)
        dtype, device = resolve_dtype(cfg, config), torch.device(cfg.device)
        ends = built_as(dtype, device, lambda: TargetEnds(config))
        ends.load_weights(Path(cfg.model_dir))
        return cls(config, ends.embed_tokens, ends.lm_head, context_limit(cfg, config),
                   cfg.device, dtype)


class TargetEnds(nn.Module):
    """A target's embedding and lm_head (tied when it ties them), nothing between."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp = TPGroup()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, model_dir: Path) -> None:
        tied = self.cfg.tie_word_embeddings
        load_checkpoint(self, model_dir, self._param_for,
                        optional=lambda name: tied and name == "lm_head.weight")

    def _param_for(self, name: str) -> tuple[str, int | None] | None:
        found = CausalLM._param_for(self, name)  # the target's own names for them
        return found if found and found[0] in ("embed_tokens.weight", "lm_head.weight") \
            else None


class HeadRunner(ModelRunner):
    """A head's runner: its weights and KV (one layer), on the target's device in the
    target's dtype; the target's embedding and lm_head where the checkpoint has none.
    No prefix caching (a block of pairs needs the token after it) and no compiled
    forward (its inputs carry features)."""

    def __init__(self, cfg: RunnerConfig, target: TargetSide) -> None:
        self.head = HeadConfig.from_dir(cfg.model_dir, target.config)
        self.own = head_tensor_names(cfg.model_dir)
        check_head_names(self.head.kind, self.own, cfg.model_dir)
        shares = "embed_tokens.weight" not in self.own or (
            self.head.kind == "eagle1" and "lm_head.weight" not in self.own)
        if shares and target.tp_size > 1:
            raise ModelConfigError(f"{cfg.model_dir}: a head that shares the target's "
                                   f"embedding or lm_head needs the target at tp=1")
        self.target = target
        # the target's dtype (its embedding and features meet the head's weights) and
        # context (a head's config may say less than the target serves)
        super().__init__(replace(cfg, prefix_caching=False, compile=False, tp=1,
                                 device=target.device, max_model_len=target.context,
                                 dtype=str(target.dtype).removeprefix("torch.")))

    @property
    def method(self) -> str:
        return HEAD_METHODS[self.head.kind]

    def read_model_config(self) -> ModelConfig:
        return replace(self.head.layer, max_position_embeddings=max(
            self.head.layer.max_position_embeddings, self.target.context))

    def new_model(self) -> DraftHead:
        return DraftHead(self.head, self.target.embed_tokens, self.target.lm_head,
                         self.own, self.max_model_len)

    @property
    def reads(self) -> FeatureTap:
        """The target's hidden states this head drafts from (EAGLE-3's fused by its fc
        as the target keeps them)."""
        return self.head.fused_tap(self.model.fc)

    @property
    def feature_width(self) -> int:
        """The feature rows it takes from a target (HeadConfig.feature_width)."""
        return self.head.feature_width

    def _forward(self, requests: list[ForwardRequest], beside_draft: bool = False
                 ) -> torch.Tensor:
        pairs = [_as_pairs(r) for r in requests]
        self._use_threads(pairs, beside_draft)
        input_ids, positions, meta, logits_rows = self._batch(pairs)
        features = torch.cat([r.features for r in pairs])  # [num_pairs, width]
        return self.step(input_ids, positions, self.kv_caches, meta, logits_rows, features)


class RemoteHead:
    """The target's side of a head that drafts on draft replicas: what it reads of the
    target (`tap`: EAGLE-3's taps fused by the head's own fc as the target keeps them, so
    one hidden vector a position travels instead of three), its method and that width."""

    def __init__(self, head_dir: str | Path, target: ModelRunner) -> None:
        self.head = HeadConfig.from_dir(head_dir, target.model_config)
        check_head_names(self.head.kind, head_tensor_names(head_dir), head_dir)
        self.method = HEAD_METHODS[self.head.kind]
        self.width = self.head.feature_width
        self.tap = self.head.tap
        if self.head.kind == "eagle3":
            taps = self.head.tap.width(target.model_config.hidden_size)
            fc = built_as(target.dtype, target.device, lambda: ReplicatedLinear(
                taps, self.width, False, TPGroup()))
            load_checkpoint(fc, Path(head_dir), lambda name: (
                ("weight", None) if name.removeprefix("model.") == "fc.weight" else None))
            self.tap = self.head.fused_tap(fc)


def _as_pairs(r: ForwardRequest) -> ForwardRequest:
    """A request over tokens as one over pairs: token t goes with the feature before it,
    at position t - 1; the first token of a sequence has no pair."""
    if r.features is None or len(r.features) != len(r.token_ids):
        raise ValueError("a head's forward needs one feature row per token")
    if r.cached_len:
        return replace(r, cached_len=r.cached_len - 1)
    if r.num_logits > len(r.token_ids) - 1:
        raise ValueError("a head drafts after two tokens at least")
    return replace(r, token_ids=r.token_ids[1:], features=r.features[1:])


def head_config_json(kind: str, target: dict, *, hidden_size: int | None = None,
                     intermediate_size: int | None = None, draft_vocab_size: int | None = None,
                     aux_layers: tuple[int, ...] | None = None) -> dict:
    """config.json of a one-layer head for the target whose config.json is `target`, as
    SpecForge writes EAGLE-3's and EAGLE's original code writes EAGLE-1's."""
    hidden = hidden_size or target["hidden_size"]
    heads = target["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3"
                          else "EagleLlamaForCausalLM"],
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": hidden, "intermediate_size": intermediate_size or target[
            "intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim") or target["hidden_size"] // heads,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rope_theta": (target.get("rope_parameters") or {}).get(
            "rope_theta", target.get("rope_theta", 10000.0)),
        "vocab_size": target["vocab_size"], "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id"),
        "torch_dtype": target.get("dtype") or target.get("torch_dtype") or "bfloat16",
    }
    if kind == "eagle3":
        config["draft_vocab_size"] = draft_vocab_size or target["vocab_size"]
        config["target_hidden_size"] = target["hidden_size"]
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers),
                                      "use_aux_hidden_state": True}
    return config


def save_head(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A head checkpoint: config.json and model.safetensors (names as the layout has
    them: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d` for EAGLE-3)."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def head_feature_width(head_dir: str | Path, target_dir: str | Path) -> int:
    """What the target keeps a position for the head in head_dir (FeatureTap.width, an
    EAGLE-3's fused): its hidden size, or Medusa's the target's."""
    target = ModelConfig.from_dir(target_dir)
    if head_kind(head_dir) == "medusa":
        return target.hidden_size
    return HeadConfig.from_dir(head_dir, target).feature_width


def head_proposer(cfg: RunnerConfig, target: ModelRunner):
    """The proposer of the head in cfg.model_dir, drafting beside `target` in its process:
    the Drafter over a HeadRunner (EAGLE-3, EAGLE-1), or Medusa's heads."""
    from outrider.engine.drafter import Drafter
    from outrider.engine.medusa import MedusaProposer

    if head_kind(cfg.model_dir) == "medusa":
        return MedusaProposer(cfg.model_dir, target)
    return Drafter(HeadRunner(cfg, TargetSide.of_runner(target)))
