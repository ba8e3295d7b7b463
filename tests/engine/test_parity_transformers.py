"""Greedy output is token-identical to transformers' generate, on the C++ kernel's
attention path (CPUs) and on the reference path (GPUs)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.engine import runner as runner_module
from outrider.engine.distributed import TPRunnerGroup
from outrider.engine.drafter import Drafter
from outrider.engine.kernels import cpu_kernels_loaded, use_cpu_kernels
from outrider.engine.runner import (
    ForwardRequest,
    ModelRunner,
    RunnerConfig,
    cpu_computes_bfloat16,
)
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import LLAMA3_ROPE, VOCAB, perturbed_copy, save_random_checkpoint
from tests.toolchain import HAS_COMPILER

NEW_TOKENS = 64


def prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(1, 40, (n,), generator=g)]


def hf_greedy(model_dir, prompt_list) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for p in prompt_list:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
        outputs.append(out[0, len(p):].tolist())
    return outputs


def outrider_greedy(model_dir, prompt_list) -> list[list[int]]:
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(model_dir))))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [s.output_ids for s in decoder.generate(prompt_list, params, gamma=0)]


CASES = {
    "llama-gqa-llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    "qwen2-qkv-bias-tied-sharded": dict(arch="qwen2", tie_word_embeddings=True,
                                        max_shard_size="60KB"),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=24, head_dim=16),
    "qwen3-qk-norm-head-dim": dict(arch="qwen3", head_dim=16, norm_noise=0.3),
}


@pytest.fixture(params=["kernel", "reference"])
def attention_path(request):
    """Each row on the C++ kernel's path (CPUs) and on the reference path (GPUs)."""
    if request.param == "kernel" and not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built on this machine")
    use_cpu_kernels(request.param == "kernel")
    try:  # a compiler but a failed build would hold the reference path twice
        assert cpu_kernels_loaded() == (request.param == "kernel")
        yield request.param
    finally:
        use_cpu_kernels(True)


@contextmanager
def reference_path():
    """The reference (pure-torch) path GPUs run, for a block."""
    use_cpu_kernels(False)
    try:
        yield
    finally:
        use_cpu_kernels(True)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    """A case's checkpoint, prompts and transformers' greedy output (once for both paths)."""
    model_dir = save_random_checkpoint(tmp_path_factory.mktemp(request.param), seed=11,
                                       **CASES[request.param])
    prompt_list = prompts()
    return model_dir, prompt_list, hf_greedy(model_dir, prompt_list)


def test_greedy_matches_transformers(case, attention_path):
    model_dir, prompt_list, expected = case
    assert outrider_greedy(model_dir, prompt_list) == expected


def test_sharded_checkpoint_has_index(tmp_path):
    model_dir = save_random_checkpoint(tmp_path, "qwen2", max_shard_size="60KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("device,checkpoint,native,expected", [
    ("cpu", torch.bfloat16, True, torch.bfloat16), ("cpu", torch.float16, True, torch.bfloat16),
    ("cpu", torch.bfloat16, False, torch.float32), ("cpu", torch.float32, True, torch.float32),
    ("cuda", torch.float16, False, torch.float16), ("cuda:1", torch.bfloat16, False,
                                                   torch.bfloat16)])
def test_dtype_auto_is_the_checkpoints_where_the_device_computes_it(monkeypatch, device,
                                                                     checkpoint, native,
                                                                     expected):
    monkeypatch.setattr(runner_module, "cpu_computes_bfloat16", lambda: native)
    assert runner_module._auto_dtype(device, checkpoint) == expected


def test_checkpoint_dtype_is_honoured(tmp_path):
    model_dir = save_random_checkpoint(tmp_path, dtype=torch.bfloat16)
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype="auto", kv_cache_mb=8))
    assert runner.model_config.dtype == torch.bfloat16
    # a CPU with bfloat16 instructions computes a half-precision checkpoint in bfloat16
    expected = torch.bfloat16 if cpu_computes_bfloat16() else torch.float32
    assert runner.dtype == expected and dtypes_a_generation_runs_in(runner) == {expected}
    half = ModelRunner(RunnerConfig(str(model_dir), dtype="bfloat16", kv_cache_mb=8))
    assert dtypes_a_generation_runs_in(half) == {torch.bfloat16}


def dtypes_a_generation_runs_in(runner: ModelRunner) -> set[torch.dtype]:
    """Of the model's weights (those kept as parameters), its KV cache, and the hidden
    states each layer and the final norm hand on while it generates."""
    seen = {p.dtype for p in runner.model.parameters()}
    seen |= {t.dtype for layer in runner.kv_caches for t in layer}
    model = runner.model
    hooks = [m.register_forward_hook(lambda m, i, out: seen.update(
        t.dtype for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)))
        for m in [*model.layers, model.norm]]
    try:
        out = SpeculativeDecoder(runner).generate([[5, 6, 7]], SamplingParams(
            max_tokens=8, ignore_eos=True), 0)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(out[0].output_ids) == 8
    return seen


# an architecture's row: its logits, and greedy output alone, speculating with a draft of
# its own kind, and over two tensor-parallel ranks (the suite's other rows cover Llama,
# Qwen2 and Mistral through the engine's, tp and speculation tests). Greedy output is held
# to transformers' generate(), or (`forward`) to its forward over the prompt and that
# output, each token its argmax: for Phi-3 with a partial rotary factor or LongRoPE its
# generate() departs from its own forward (transformers 5.23).
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.3, 2.1, 3.7, 1.2, 1.9, 2.8, 5.0],
                long_factor=[1.1, 2.5, 4.0, 9.0, 1.4, 3.3, 6.1, 12.0])
PHI3 = dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
            norm_noise=0.3)
ARCHITECTURES = {
    "qwen3": dict(arch="qwen3", head_dim=16, norm_noise=0.3),
    # fused qkv and gate/up tensors; LongRoPE within its original context (its short
    # factors; crossing to the long ones: test_longrope_*)
    "phi3-longrope": dict(PHI3, original_max_position_embeddings=256,
                          rope_scaling=LONGROPE, reference="forward"),
    # Phi-4-mini's shape: part of each head rotated; a sliding window
    "phi3-partial-rotary-window": dict(PHI3, partial_rotary_factor=0.5, sliding_window=32,
                                       reference="forward"),
    # routed experts: top-2 of 4, renormalised (Mixtral); top-2 of 8 as they come, a dense
    # first layer (Qwen3-MoE's mlp_only_layers). Against the forward: where the router
    # nearly ties, transformers' generate() (a token a forward) and its forward pick
    # different experts from rounding alone
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    reference="forward"),
    # (1 + w) norms, scaled embeddings, GELU, sandwich norms, query_pre_attn_scalar, every
    # third layer global with its own RoPE base and linear scaling, the others windowed
    "gemma3": dict(arch="gemma3", head_dim=16, query_pre_attn_scalar=24, sliding_window=20,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   num_hidden_layers=3, norm_noise=0.3, rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 100000.0}}),
    # Gemma 2: attention scores and logits soft-capped (low caps, so they bite), layers
    # alternating windowed and global
    "gemma2": dict(arch="gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=20,
                   num_hidden_layers=3, norm_noise=0.3, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0),
    "qwen3-moe": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, head_dim=16,
                      moe_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
                      norm_noise=0.3, reference="forward"),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_architecture_matches_transformers_alone_speculating_and_over_two_ranks(
        tmp_path, tokenizer_dir, arch):
    overrides = dict(ARCHITECTURES[arch])
    reference = overrides.pop("reference", "generate")
    target = save_random_checkpoint(tmp_path / "target", seed=11, tokenizer_from=tokenizer_dir,
                                    **overrides)
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.1)
    prompt_list = prompts(4)
    expected = outrider_greedy(target, prompt_list)  # on the kernel's path, where built
    if reference == "generate":
        assert expected == hf_greedy(target, prompt_list)
    else:
        assert all(hf_argmax_path(target, p, out) for p, out in zip(prompt_list, expected))
    assert max_logit_difference(target, prompt_list[0] + expected[0]) < 1e-4
    for tp in (1, 2):
        assert speculated(target, draft, prompt_list, tp) == expected, f"tp={tp}"
    with reference_path():  # the path GPUs run: the same output and logits
        assert outrider_greedy(target, prompt_list) == expected, "reference path"
        assert max_logit_difference(target, prompt_list[0] + expected[0]) < 1e-4
        if arch in SPECULATED_ON_THE_REFERENCE_PATH:
            assert speculated(target, draft, prompt_list, 1) == expected, "reference path"


# verification rows on the reference path (short queries over a cache): soft-capped
# scores and windows beside global layers; the kernel's path speculates on every row
SPECULATED_ON_THE_REFERENCE_PATH = ("gemma2",)


def speculated(target, draft, prompt_list, tp: int) -> list[list[int]]:
    """Greedy output speculating with `draft` (γ 4) over `tp` ranks; some drafts accepted."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    group = TPRunnerGroup(RunnerConfig(str(target), tp=tp, kv_cache_mb=8))
    try:
        drafter = Drafter(ModelRunner(RunnerConfig(str(draft), kv_cache_mb=8)))
        seqs = SpeculativeDecoder(group.runner, drafter).generate(prompt_list, greedy, gamma=4)
    finally:
        group.close()
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    return [s.output_ids for s in seqs]


def hf_argmax_path(model_dir, prompt: list[int], output: list[int]) -> bool:
    """Whether every output token is transformers' argmax after the tokens before it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return logits.argmax(-1).tolist() == output


def max_logit_difference(model_dir, prompt: list[int]) -> float:
    """Largest |ours - transformers'| over a prompt's logits (float32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    runner = ModelRunner(RunnerConfig(str(model_dir), kv_cache_mb=8))
    runner.blocks.append("p", len(prompt))
    ours = runner.forward([ForwardRequest(prompt, 0, runner.blocks.block_table("p"),
                                          len(prompt))])
    return (ours - theirs).abs().max().item()


def test_longrope_takes_the_long_factors_from_the_original_context_on(tmp_path):
    """Each position by its own, as transformers rotates a token generated there: the
    short factors below the original context, the long ones from it, cos and sin scaled
    by the attention factor."""
    from transformers import AutoModelForCausalLM

    model_dir = save_random_checkpoint(tmp_path, **dict(
        PHI3, original_max_position_embeddings=48, rope_scaling=LONGROPE))
    theirs = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb
    ours = ModelRunner(RunnerConfig(str(model_dir), kv_cache_mb=8)).model.rope
    for position in (0, 47, 48, 300):  # a token at p: transformers' sequence has p + 1
        cos, sin = theirs(torch.zeros(1, 1, 16), torch.tensor([[position]]))
        assert torch.allclose(ours.cos[position], cos[0, 0], atol=1e-6)
        assert torch.allclose(ours.sin[position], sin[0, 0], atol=1e-6)


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration: its text_config (partial, Gemma 3's defaults
    filling the rest) and its language model's tensors; the vision tower is not loaded.
    Greedy output is transformers' argmax path on text alone."""
    from transformers import AutoModelForCausalLM, Gemma3Config, SiglipVisionConfig
    from transformers.models.gemma3 import Gemma3TextConfig

    torch.manual_seed(5)
    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, initializer_range=0.25,
                            sliding_window=16, layer_types=["sliding_attention",
                                                            "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    prompt_list = prompts(2)
    outputs = outrider_greedy(tmp_path, prompt_list)
    assert all(hf_argmax_path(tmp_path, p, out) for p, out in zip(prompt_list, outputs))


def test_a_gemma3_text_config_lists_only_what_differs_from_its_defaults():
    """As Gemma 3's multimodal checkpoints ship it (gemma-3-4b-it's text_config)."""
    from outrider.core.hf_config import text_model
    from outrider.engine.model_config import ModelConfig

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "sliding_window": 1024,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    cfg = ModelConfig.from_hf_dict(text_model(raw))
    assert (cfg.architecture, cfg.vocab_size, cfg.head_dim, cfg.num_heads) == (
        "Gemma3ForCausalLM", 262208, 256, 8)
    assert cfg.sliding_windows[:6] == (1024,) * 5 + (None,) and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.dtype == torch.bfloat16 and cfg.query_scale == 256 ** -0.5
