"""Draft heads that read the target's hidden states (outrider/engine/heads.py,
medusa.py): the layouts load and compute what vLLM's EAGLE-3, EAGLE-1 and Medusa layers
compute (checked against a dense reference written here from the papers' equations, with
the target's hidden states from `transformers`), and speculating with any of them changes
nothing but the speed: greedy output is the target's alone."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from outrider.core.hf_config import ModelConfigError, head_kind
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.engine.drafter import Drafter
from outrider.engine.features import FeatureLog
from outrider.engine.heads import HeadRunner, TargetSide, head_proposer
from outrider.engine.medusa import MedusaProposer
from outrider.engine.mix import ProposerMix
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.engine.tree import TreeShape
from tests.checkpoints import save_random_head, save_random_medusa

AUX = (0, 1, 2)  # the session's 2-layer target: embeddings, layer 1's input, the output
LAYOUTS = {
    "eagle3-draft-vocab": dict(kind="eagle3", draft_vocab=160, aux_layers=AUX),
    "eagle3-own-embedding": dict(kind="eagle3", own_embedding=True, aux_layers=AUX),
    "eagle1": dict(kind="eagle1"),
    "medusa-vllm-names": dict(kind="medusa"),
    "medusa-authors-names": dict(kind="medusa", authors_names=True, num_layers=2),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def head_dir(request, tmp_path_factory, llama_dir):
    layout = dict(LAYOUTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    if layout.pop("kind") == "medusa":
        return save_random_medusa(path, llama_dir, **layout)
    return save_random_head(path, llama_dir, kind=request.param[:6], **layout)


@pytest.fixture(scope="module")
def target(llama_dir):
    return ModelRunner(RunnerConfig(str(llama_dir), dtype="float32", kv_cache_mb=32))


# -- a dense reference of the layers --------------------------------------------------------

def rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, theta):  # x: [T, heads, d] at positions 0..T-1, rotate-half RoPE
    d = x.shape[-1]
    angles = torch.arange(x.shape[0])[:, None] * theta ** (-torch.arange(0, d, 2) / d)
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_logits(head_dir, llama_dir, ids: torch.Tensor) -> torch.Tensor:
    """The head's logits over the target's vocabulary for each pair (feature at p, token
    at p + 1) of `ids` [T], p = 0 .. T-2: [T - 1, vocab]."""
    from transformers import LlamaForCausalLM

    cfg = json.loads((head_dir / "config.json").read_text())
    w = {k.removeprefix("midlayer.").removeprefix("layers.0."): v.float()
         for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    target = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    n = target.config.num_hidden_layers
    prenorm = []  # transformers' last hidden state is normed; layer id L is the input of
    #               the final norm (vLLM's)
    hook = target.model.norm.register_forward_hook(lambda m, i, o: prenorm.append(i[0][0]))
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
        last = target.model(input_ids=ids[None]).last_hidden_state[0]  # normed
    hook.remove()
    states = [h[0] for h in out.hidden_states[:-1]] + prenorm[:1]  # entering layer i
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight)
    emb = embed[ids[1:]]
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = cfg.get("rope_theta", 10000.0)  # (Llama's default: published heads omit it)
    if cfg["architectures"] == ["LlamaForCausalLMEagle3"]:
        # the taps the config names, else vLLM's default: entering layers 2, L/2, L - 3
        taps = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or [2, n // 2, n - 3])
        feature = torch.cat([states[i][:-1] for i in taps], -1) @ w["fc.weight"].T
        x = torch.cat([rms(emb, w["input_layernorm.weight"], eps),
                       rms(feature, w["hidden_norm.weight"], eps)], -1)
        residual = feature
    else:
        x = torch.cat([emb, last[:-1]], -1) @ w["fc.weight"].T + w["fc.bias"]
        residual = x
    T = len(emb)
    q = rotate((x @ w["self_attn.q_proj.weight"].T).view(T, heads, d), theta)
    k = rotate((x @ w["self_attn.k_proj.weight"].T).view(T, kv, d), theta)
    v = (x @ w["self_attn.v_proj.weight"].T).view(T, kv, d)
    k, v = (t.repeat_interleave(heads // kv, 1).transpose(0, 1) for t in (k, v))
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    residual = residual + attn.transpose(0, 1).reshape(T, -1) @ w["self_attn.o_proj.weight"].T
    h = rms(residual, w["post_attention_layernorm.weight"], eps)
    out_h = residual + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
                        ) @ w["mlp.down_proj.weight"].T
    if "norm.weight" not in w:  # EAGLE-1: the target's lm_head on the output as it is
        return out_h @ target.lm_head.weight.T
    logits = rms(out_h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((T, target.config.vocab_size), float("-inf"))
    d2t = w.get("d2t", torch.zeros(len(logits[0]))).long()
    full[:, torch.arange(len(d2t)) + d2t] = logits
    return full


def medusa_reference(head_dir, llama_dir, ids: torch.Tensor) -> torch.Tensor:
    """Medusa head k's logits at the last position of `ids`: [num_heads, vocab]."""
    from transformers import LlamaForCausalLM

    cfg = json.loads((head_dir / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    target = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        last = target.model(input_ids=ids[None]).last_hidden_state[0, -1]  # normed
    num_layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    out = []
    for k in range(cfg.get("medusa_num_heads", cfg.get("num_heads"))):
        x = last
        for layer in range(num_layers):
            if f"{k}.{layer}.linear.weight" in w:
                x = x + F.silu(x @ w[f"{k}.{layer}.linear.weight"].T
                               + w[f"{k}.{layer}.linear.bias"])
            else:
                x = x + F.silu(x @ w[f"blocks.{k}.layers.{layer}.weight"].T)
        out.append(x @ w.get(f"lm_heads.{k}.weight", w.get(f"{k}.{num_layers}.weight")).T)
    return torch.stack(out)


def test_a_head_computes_what_its_layout_means(head_dir, llama_dir, target):
    """The target keeps the hidden states the head reads as it verifies, and the head's
    forward over pairs (prompt-like: many at once, then one more as in a chain) gives the
    reference's logits; Medusa's heads give theirs from the last position's state."""
    if head_kind(head_dir) == "medusa":
        check_medusa(head_dir, llama_dir, target)
        return
    check_head(head_dir, llama_dir, target)


# config.json of a published EAGLE-3 head as its authors wrote it (SpecForge's
# configs/llama3-8B-eagle3.json, the layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), its
# sizes scaled down to a test target's: no head_dim (hidden / heads: here 16, the
# target's 8), no rope_theta (Llama's 10000; the target's is Llama 3.1's 500000), no
# eagle_config (vLLM's default taps), float16, and a draft vocabulary of its own
PUBLISHED_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 96, "max_position_embeddings": 2048, "model_type": "llama",
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
    "vocab_size": 320, "draft_vocab_size": 100}


def save_published_eagle3(path, seed: int = 0):
    """A head in PUBLISHED_EAGLE3's layout with random weights under the tensor names the
    published checkpoints hold (d2t: target id - draft id; t2d: which target ids the
    draft vocabulary has), written here, not by the project's own writer."""
    from safetensors.torch import save_file

    cfg, g = PUBLISHED_EAGLE3, torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = hidden  # heads * head_dim, head_dim = hidden / heads
    kv_out = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]

    def rand(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.float16)

    def norm(width):
        return (1 + 0.3 * torch.randn(width, generator=g)).to(torch.float16)

    target_ids = torch.randperm(vocab, generator=g)[:cfg["draft_vocab_size"]].sort().values
    tensors = {
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": rand(q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q_out),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "fc.weight": rand(hidden, 3 * hidden),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(cfg["draft_vocab_size"], hidden) * 4,
        "d2t": target_ids - torch.arange(cfg["draft_vocab_size"]),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(PUBLISHED_EAGLE3, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_published_eagle3_layout_computes_what_it_means(tmp_path):
    """PUBLISHED_EAGLE3 under an 8-layer target (vLLM's default taps: layers 2, 4, 5)
    gives the dense reference's logits."""
    from tests.checkpoints import save_random_checkpoint

    target_dir = save_random_checkpoint(tmp_path / "target", num_hidden_layers=8,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 500000.0})
    head_dir = save_published_eagle3(tmp_path / "head")
    target = ModelRunner(RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=8))
    check_head(head_dir, target_dir, target)


def check_head(head_dir, target_dir, target: ModelRunner) -> None:
    """An EAGLE head's logits against reference_logits'."""
    head = HeadRunner(RunnerConfig(str(head_dir), dtype="float32", kv_cache_mb=8),
                      TargetSide.of_runner(target))
    target.keep_features(head.reads)
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 7, 12, 88, 160, 2, 31])
    try:
        target.blocks.append("t", len(ids))
        target.forward([ForwardRequest(ids.tolist(), 0, target.blocks.block_table("t"), 1)])
        features = target.features  # [T, width]: feature of every position
    finally:
        target.blocks.free("t")
        target.keep_features(None)
    expected = reference_logits(head_dir, target_dir, ids)  # [T - 1, vocab]
    n = len(ids) - 1  # all but the last token go in at once, then the last one alone
    head.blocks.append("h", len(ids))
    rows = torch.cat([features.new_zeros(1, features.shape[1]), features[:-1]])
    first = head.forward([ForwardRequest(ids[:n].tolist(), 0, head.blocks.block_table("h"),
                                         n - 1, rows[:n])])
    last = head.forward([ForwardRequest(ids[n:].tolist(), n, head.blocks.block_table("h"), 1,
                                        rows[n:])])
    got = torch.cat([first, last])
    finite = expected.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


def check_medusa(head_dir, llama_dir, target):
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 7, 12, 88, 160, 2, 31])
    medusa = MedusaProposer(str(head_dir), target)
    target.keep_features(medusa.reads_target)
    try:
        target.blocks.append("t", len(ids))
        target.forward([ForwardRequest(ids.tolist(), 0, target.blocks.block_table("t"), 1)])
        feature = target.features[-1:]  # [1, hidden]
    finally:
        target.blocks.free("t")
        target.keep_features(None)
    got = torch.cat([medusa.heads(k, feature) for k in range(medusa.num_heads)])
    torch.testing.assert_close(got, medusa_reference(head_dir, llama_dir, ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("proposer", ["model", "auto", "tree"])
def test_greedy_speculation_with_a_head_is_the_target_alone(head_dir, llama_dir, proposer):
    """A batch of prompts of several lengths, γ 3: the head (alone, beside the lookups, or
    drafting token trees of top-k 3) drafts every round it is asked and output is the
    target's greedy output."""
    prompts = [[5, 17, 99, 3, 250, 41, 7], [12, 88], [160, 2, 31, 5, 17, 99, 3, 250, 41, 7,
                                                      12, 88, 99, 3]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    target = ModelRunner(RunnerConfig(str(llama_dir), dtype="float32", kv_cache_mb=32))
    alone = SpeculativeDecoder(target).generate(prompts, params, gamma=0)
    head = head_proposer(RunnerConfig(str(head_dir), dtype="float32", kv_cache_mb=8), target)
    mix = ProposerMix(head, target.vocab_size,
                      ProposerKind.MODEL if proposer == "tree" else ProposerKind(proposer))
    tree = TreeShape(3, 8) if proposer == "tree" else None
    decoder = SpeculativeDecoder(target, mix, overlap_max_seqs=8, tree=tree,
                                 choose_trees=False)
    trees = []
    walk_trees = decoder._walk_trees

    def noted(step, ready, *args):
        trees.extend(r.tree is not None for r in ready)
        return walk_trees(step, ready, *args)
    decoder._walk_trees = noted
    for second_time in (False, True):  # then the target's cache holds every prompt
        out = decoder.generate(prompts, params, gamma=3)
        assert [s.token_ids for s in out] == [s.token_ids for s in alone]
        # most rounds of each sequence speculated: with the head alone (model), or with
        # the head or the lookups (auto: the second time the suffix lookup finds the
        # first time's outputs, and leads alone)
        for s in out:  # (its first token comes from the prefill, its last round has
            #             room for no draft)
            assert s.stats.drafted_per_position[0] >= s.stats.num_rounds - 2, s.stats
        # every drafted token counted under the proposer that drafted it: the head's
        # under its own method, vLLM's name for it (not the draft model's)
        assert mix.method == head.method in ("eagle3", "eagle", "medusa")
        counted: dict[str, int] = {}
        for s in out:
            for method, (num_drafted, _) in s.stats.by_proposer.items():
                counted[method] = counted.get(method, 0) + num_drafted
        assert sum(counted.values()) == sum(s.stats.num_draft_tokens for s in out)
        if proposer == "auto" and second_time:  # the suffix lookup leads, the head fills in
            assert counted.keys() == {head.method, "suffix"} and counted["suffix"] > 0
        else:  # alone, or (auto) before the lookups have anything to find
            assert counted.keys() == {head.method}, counted
    assert any(trees) == (proposer == "tree")  # rounds verified as trees, when asked
    # every sequence's KV went back, the target's and the head's, and no feature is kept
    assert target.blocks.num_used_blocks == 0
    assert not decoder.features._logs and not mix._held
    assert (head.runner.blocks.num_used_blocks == 0 if isinstance(head, Drafter)
            else not head._tokens)


def test_bad_heads_are_refused_naming_the_problem(tmp_path, llama_dir, target):
    good = save_random_head(tmp_path / "good", llama_dir, aux_layers=AUX)
    config = json.loads((good / "config.json").read_text())

    def refused(name: str, change: dict) -> str:
        bad = save_random_head(tmp_path / name, llama_dir, aux_layers=AUX)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelConfigError) as err:
            HeadRunner(RunnerConfig(str(bad), kv_cache_mb=8), TargetSide.of_runner(target))
        return str(err.value)

    assert "not layers of a 2-layer target" in refused(
        "layers", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}})
    assert "target_hidden_size 48 differs" in refused("width", {"target_hidden_size": 48})
    assert "norm_before_fc" in refused("norm", {"norm_before_fc": True})
    # a draft model's checkpoint under a head's config.json
    model_as_head = tmp_path / "model_as_head"
    model_as_head.mkdir()
    for f in llama_dir.iterdir():
        (model_as_head / f.name).write_bytes(f.read_bytes())
    (model_as_head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="lacks fc.weight"):
        HeadRunner(RunnerConfig(str(model_as_head), kv_cache_mb=8), TargetSide.of_runner(target))


def test_the_feature_log_keeps_rows_until_a_head_holds_them():
    """Rows go with the tokens after them (token 0: a zero row); asking does not consume
    them (a round the head could not draft for sends them again); once the head holds n
    tokens only the feature of position n - 1 on is kept; a recomputed prefix (a
    preempted sequence, chunk by chunk) replaces what the log held there and keeps the
    rest."""
    log = FeatureLog()
    log.add("s", 0, torch.arange(5.0)[:, None])  # positions 0-4
    assert log.rows_for("s", 0, 3).flatten().tolist() == [0.0, 0.0, 1.0]
    assert log.rows_for("s", 0, 3) is not None  # still there
    log.taken("s", 4)
    assert log.rows_for("s", 3, 1) is None  # position 2 is gone
    assert log.rows_for("s", 4, 2).flatten().tolist() == [3.0, 4.0]
    log.add("s", 5, torch.tensor([[5.0], [6.0]]))
    assert log.rows_for("s", 4, 4).flatten().tolist() == [3.0, 4.0, 5.0, 6.0]
    log.add("s", 0, torch.full((3, 1), 9.0))  # recomputed from the start, a chunk
    assert log.rows_for("s", 1, 7).flatten().tolist() == [9.0] * 3 + [3.0, 4.0, 5.0, 6.0]
    log.add("s", 3, torch.full((2, 1), 8.0))  # its next chunk replaces what it recomputes
    assert log.rows_for("s", 1, 7).flatten().tolist() == [9.0] * 3 + [8.0] * 2 + [5.0, 6.0]
    log.add("s", 9, torch.zeros(1, 1))  # a gap: what came before is of no use
    assert log.rows_for("s", 7, 1) is None and log.rows_for("s", 10, 1) is not None


def test_a_head_takes_the_targets_dtype_and_context(tmp_path, llama_dir):
    """A float32 head under a bfloat16 target (its embedding and features meet the head's
    weights), a head config with a shorter context than the target serves, and an
    identity d2t in a full-vocabulary checkpoint (SpecForge saves one) all serve."""
    from safetensors.torch import load_file, save_file

    head_dir = save_random_head(tmp_path / "head", llama_dir, aux_layers=AUX)
    config = json.loads((head_dir / "config.json").read_text())
    config |= {"torch_dtype": "float32", "max_position_embeddings": 64}
    (head_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors["d2t"] = torch.zeros(config["vocab_size"], dtype=torch.long)
    save_file(tensors, str(head_dir / "model.safetensors"))
    target = ModelRunner(RunnerConfig(str(llama_dir), dtype="bfloat16", kv_cache_mb=16,
                                      max_model_len=256))
    head = head_proposer(RunnerConfig(str(head_dir), kv_cache_mb=8), target)
    assert head.runner.dtype == torch.bfloat16 and head.max_model_len == 256
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    out = SpeculativeDecoder(target, head).generate([[5, 17, 99, 3]], params, gamma=3)[0]
    assert out.stats.drafted_per_position[0] >= out.stats.num_rounds - 2  # past 64 too


def test_a_head_drafts_on_a_cached_prefix_from_the_features_kept_beside_it():
    """With the head's features kept beside the target's KV (RunnerConfig.feature_width:
    the demo EAGLE-3 head's fused width), a request sharing a long prompt with an earlier
    one starts on the cached prefix with the features the target computes there, and its
    output is the target's alone, the head drafting; without them nothing is shared."""
    from outrider.core.tokenizer import Tokenizer
    from outrider.engine.heads import head_feature_width
    from outrider.paths import models_dir

    target_dir, head_dir = models_dir() / "demo-target", models_dir() / "demo-eagle3"
    tokenizer = Tokenizer(target_dir)
    shared = tokenizer.encode("import os\nimport sys\n\n\nclass Walker:\n    def __init__(self, "
                              "root):\n        self.root = root\n        self.seen = set()\n\n"
                              "    def walk(self):\n        for name in os.listdir(self.root):")
    prompts = [shared + tokenizer.encode(t) for t in ("\n            yield name\n",
                                                      "\n            if name in self.seen:")]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def decoder(feature_width: int) -> SpeculativeDecoder:
        target = ModelRunner(RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=8,
                                          feature_width=feature_width))
        return SpeculativeDecoder(target, head_proposer(
            RunnerConfig(str(head_dir), kv_cache_mb=4), target))

    width = head_feature_width(head_dir, target_dir)
    assert width == 320  # EAGLE-3's three taps, fused by its fc
    caching, fresh = decoder(width), decoder(0)
    assert caching.reuses_prefixes and not fresh.reuses_prefixes
    first = caching.generate(prompts[:1], params, gamma=4)[0]
    # the cached prefix comes with the features the target computes for it
    seq = caching.new_sequence(prompts[1], params)
    caching.admit(seq)
    n = seq.target_len
    assert n >= 48
    cached = caching.features.rows_for(seq.seq_id, 1, n)  # positions 0 .. n-1
    caching.release(seq)
    target = fresh.target
    target.blocks.append("x", n)
    target.forward([ForwardRequest(prompts[1][:n], 0, target.blocks.block_table("x"), 1)])
    target.blocks.free("x")
    assert torch.allclose(cached, target.features, atol=1e-5)
    second = caching.generate(prompts[1:], params, gamma=4)[0]
    assert second.num_cached_tokens == n
    assert fresh.generate(prompts[1:], params, gamma=4)[0].num_cached_tokens == 0
    alone = SpeculativeDecoder(ModelRunner(RunnerConfig(str(target_dir), dtype="float32"))
                               ).generate(prompts, params, gamma=0)
    assert [first.output_ids, second.output_ids] == [s.output_ids for s in alone]
    assert second.stats.num_accepted_tokens > 0


def finish_as_the_target_alone(decoder: SpeculativeDecoder, seq, target_dir) -> list:
    """Run `seq` to its end at γ 4; its rounds. Its output must be the target's alone."""
    rounds = []
    while not seq.is_finished:
        decoder.step([seq], [4])
        rounds.append(seq.last_round)
    alone = SpeculativeDecoder(ModelRunner(RunnerConfig(str(target_dir), dtype="float32"))
                               ).generate([seq.token_ids[:seq.prompt_len]], seq.params, 0)[0]
    assert seq.output_ids == alone.output_ids
    return rounds


@pytest.mark.parametrize("mixed", [False, True], ids=["head", "head-in-mix"])
def test_a_head_takes_in_the_features_that_pile_up_while_it_drafts_nothing(mixed):
    """A long stretch of steps without speculation (a hot batch): the head takes in the
    committed tokens while the target verifies once HEAD_FEED_TOKENS of their features
    are waiting, so the log stays short; speculating again, it drafts from there (its
    drafts kept) and the output is the target's alone."""
    from outrider.engine.spec_decode import HEAD_FEED_TOKENS
    from outrider.paths import models_dir

    target_dir, head_dir = models_dir() / "demo-target", models_dir() / "demo-eagle3"
    target = ModelRunner(RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=8))
    head = head_proposer(RunnerConfig(str(head_dir), kv_cache_mb=4), target)
    decoder = SpeculativeDecoder(target, ProposerMix(head, target.vocab_size,
                                                     ProposerKind.MODEL) if mixed else head)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250, 41, 7, 12]
    seq = decoder.new_sequence(prompt, params)
    logged = []
    while seq.num_output < 150:  # off: one token a step
        decoder.step([seq], [0])
        first, chunks = decoder.features._logs[seq.seq_id]
        logged.append(sum(map(len, chunks)))
    assert max(logged) <= HEAD_FEED_TOKENS + 1 and seq.draft_len > 100, (max(logged), seq.draft_len)
    rounds = finish_as_the_target_alone(decoder, seq, target_dir)
    assert sum(r.num_accepted for r in rounds) > len(rounds), rounds  # > 1 a round


@pytest.mark.parametrize("feature_width", [320, 0], ids=["features-cached", "none"])
def test_a_head_that_lost_a_sequence_drafts_again_from_the_cached_features(feature_width):
    """The head (beside the lookups, as a replica runs it) loses a sequence mid-way — a
    draft replica restarted, say: it answers MISS, the loop sends the whole context, and
    the target's cache of every committed position's features (feature_width) gives the
    head what it reads, so it drafts again; without that cache it cannot. The output is
    the target's alone either way."""
    from outrider.paths import models_dir

    target_dir, head_dir = models_dir() / "demo-target", models_dir() / "demo-eagle3"
    target = ModelRunner(RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=8,
                                      feature_width=feature_width))
    head = head_proposer(RunnerConfig(str(head_dir), kv_cache_mb=4), target)
    decoder = SpeculativeDecoder(target, ProposerMix(head, target.vocab_size,
                                                     ProposerKind.MODEL))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250, 41, 7, 12]
    seq = decoder.new_sequence(prompt, params)
    while seq.num_output < 20:
        decoder.step([seq], [4])
    assert head.release(seq.seq_id)  # lost
    after = finish_as_the_target_alone(decoder, seq, target_dir)
    kept = sum(r.num_accepted for r in after)
    assert (kept > len(after)) if feature_width else (kept == 0), after
