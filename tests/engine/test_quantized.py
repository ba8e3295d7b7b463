"""Quantized checkpoints as compressed-tensors writes them (the format llm-compressor
saves): each scheme's forward held to compressed-tensors' own decompression of the same
checkpoint, on the packed CPU kernel where the scheme has one; speculation over a
quantized target, alone and over two tensor-parallel ranks, is its greedy output.

GPTQ and AWQ: the readers held to AutoGPTQ's and AutoAWQ's own dequantization of small
linears they packed (data/gptq_awq_golden.safetensors), the tests' packers to their
words bit for bit, and a model packed so to its dequantized copy, on its kernel.

fp8 (DeepSeek-V3's, vLLM's `fp8` method): a model cast so held to transformers'
FineGrainedFP8 dequantizing it, and where the blocks are short (which transformers
refuses) to DeepSeek-V3's weight_dequant written out (tests/checkpoints.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.engine.checkpoint import CheckpointError
from outrider.engine.distributed import TPRunnerGroup
from outrider.engine.drafter import Drafter
from outrider.engine.model_config import ModelConfig, ModelConfigError
from outrider.engine.parallel import (
    ColumnParallelLinear,
    PackedForCPU,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    linear_weights_deferred,
)
from outrider.engine.quant.formats import FORMATS, read_compressed_tensors, read_fp8
from outrider.engine.quant.scheme import QuantScheme
from outrider.engine.quant.weight import (
    Fp8Linear,
    Int4GemmLinear,
    Int4Linear,
    Int8Int8Linear,
    Int8Linear,
    QuantizedWeight,
    _int8_cuda_matmul,
    cpu_kernel,
    fp8_on_load,
    fp8_rows,
    has_int4_gemm,
    has_int8_amx,
)
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig, built_as
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import (
    awq_copy,
    dequantized_copy,
    edit_config,
    fp8_copy,
    fp8_dequantized,
    gptq_copy,
    pack_awq,
    pack_gptq,
    quantized_copy,
    save_random_checkpoint,
)
from tests.toolchain import needs_int8_gemm

# the 4-bit matmul: Outrider's kernel where the CPU has AVX512-BF16, else torch's
INT4 = Int4GemmLinear if has_int4_gemm() else Int4Linear
# scheme (a compressed-tensors preset, its group size) -> the matmul its linears run in
# bf16 (in fp32 every one is dequantized)
SCHEMES = {
    "W4A16": (32, INT4),                # 4-bit groups, symmetric: an int4 kernel
    "W4A16_ASYM": (64, INT4),           # with packed zero points
    "W8A16_g32": (32, None),            # 8-bit groups: dequantized at load
    "W8A16": (-1, Int8Linear),          # 8-bit per channel: the weight-only int8 kernel
    "W8A8": (None, Int8Int8Linear),     # ... and int8 inputs per token: the int8 GEMM
    "FP8_DYNAMIC": (None, None),        # FP8 per channel: dequantized
    "FP8": (None, None),                # FP8 per tensor (its static input scales unused)
}
# a GPTQ or AWQ copy (tests/checkpoints.py's writer, its arguments) -> its linears' matmul
# in bf16
PACKED = {
    "gptq4_sym": (gptq_copy, dict(bits=4, group_size=32), INT4),
    "gptq4_asym": (gptq_copy, dict(bits=4, group_size=64, sym=False), INT4),
    "gptq4_v2": (gptq_copy, dict(sym=False, checkpoint_format="gptq_v2"), INT4),
    "gptq4_act_order": (gptq_copy, dict(sym=False, act_order=True), None),  # dequantized
    "gptq8_channel": (gptq_copy, dict(bits=8, group_size=-1), Int8Linear),
    "awq4": (awq_copy, dict(group_size=32), INT4),
}
# fp8 case -> fp8_copy's options (a model ours reads, and transformers' copy of it)
FP8_CASES = {
    "blocks_16": dict(block=(16, 16)),      # weight_scale_inv a block, lm_head dense
    "per_tensor_static": dict(static=True),  # weight_scale a tensor, input_scale unused
    "head_quantized": dict(block=(16, 16), not_converted=("model.layers.0.mlp.down_proj",)),
}
# golden variant (data/make_gptq_awq_golden.py) -> (format, bits)
GOLDEN = {"gptq4_sym": ("gptq", 4), "gptq4_asym_act": ("gptq", 4),
          "gptq8_asym_channel": ("gptq", 8), "gptq8_sym": ("gptq", 8), "awq4": ("awq", 4)}
PROMPT = [5, 17, 33, 2, 90, 64, 11, 250, 7, 41, 19, 3]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    return save_random_checkpoint(tmp_path_factory.mktemp("quant") / "base", seed=5,
                                  tokenizer_from=tokenizer_dir, initializer_range=0.1)


def logits(model_dir, prompt: list[int], dtype: str = "float32", **options) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of a prefill (`options`: RunnerConfig's)."""
    runner = ModelRunner(RunnerConfig(str(model_dir), kv_cache_mb=8, dtype=dtype, **options))
    runner.blocks.append("p", len(prompt))
    return runner.forward([ForwardRequest(prompt, 0, runner.blocks.block_table("p"),
                                          len(prompt))])


def matmuls(runner: ModelRunner) -> set:
    return {type(m.quantized_matmul) if m.quantized_matmul is not None else None
            for m in runner.model.modules() if hasattr(m, "quantized_parts")}


@pytest.mark.parametrize("scheme", [pytest.param(scheme, marks=needs_int8_gemm)
                                    if kernel is Int8Int8Linear else scheme
                                    for scheme, (_, kernel) in SCHEMES.items()])
def test_a_scheme_computes_what_compressed_tensors_decompresses(base, tmp_path, scheme):
    """W8A8's reference quantizes each linear's inputs as compressed-tensors' own forward
    does (dynamic, per token), in every dtype."""
    group, kernel = SCHEMES[scheme]
    quantized = quantized_copy(base, tmp_path / scheme, scheme.partition("_g")[0], group)
    inputs = json.loads((quantized / "config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]["input_activations"]
    with fake_quantized_inputs(inputs):
        computes_its_reference(quantized, dequantized_copy(quantized, tmp_path / "reference"),
                               base, kernel)


@contextlib.contextmanager
def fake_quantized_inputs(args: dict | None):
    """Every dense linear but the head quantizes its input first, by compressed-tensors'
    dynamic scales and fake quantization (`args`: a config group's input_activations;
    None: inputs as they are)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    if args is None or args.get("type") != "int":
        yield
        return
    args, matmul = QuantizationArgs.model_validate(args), PackedForCPU.matmul

    def quantizing(module, x):
        if module.quantized_matmul is None and not isinstance(module, ParallelLMHead):
            tokens = x.float().unsqueeze(0)  # [1, rows, in]: its tokens as it counts them
            scale, zero = compute_dynamic_scales_and_zp(tokens, args, module)
            x = fake_quantize(tokens, scale, zero, args)[0].to(x.dtype)
        return matmul(module, x)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PackedForCPU, "matmul", quantizing)
        yield


@needs_int8_gemm
@pytest.mark.parametrize("input_scale", [None, 0.02])
@pytest.mark.parametrize("in_features", [96, 128])  # oneDNN; AMX tiles where the CPU has them
def test_int8_inputs_are_batch_invariant_and_exact(input_scale, in_features):
    """A row's W8A8 product is the same bits alone as among others (any scale per batch
    would break it, and with it speculation's equality with the target alone), and its
    reference's: inputs rounded by their row's scale (None) or a static one, the sums
    exact; in bfloat16, the float32 product rounded once."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (48, in_features), dtype=torch.int8)  # 3 blocks of 16
    weight = QuantizedWeight(q, torch.rand(48, 1) / 100, None, 8, None, True, input_scale)
    product = Int8Int8Linear(weight)
    assert product.amx == (in_features == 128 and has_int8_amx())
    x = torch.randn(600, in_features).bfloat16().float()  # > ONEDNN_MAX_ROWS: pieced
    together = product(x)
    alone = torch.cat([product(x[i:i + n]) for i, n in ((0, 1), (1, 5), (6, 17), (23, 577))])
    assert torch.equal(together, alone)
    scale = (x.abs().amax(-1, keepdim=True) / 127.5 if input_scale is None
             else torch.tensor(input_scale))
    levels = (x / scale).round().clamp(-128, 127)
    expected = (levels.double() @ q.double().t()) * scale.double() * weight.scale.double().t()
    assert torch.allclose(together.double(), expected, rtol=1e-5, atol=1e-6)
    in_bf16 = Int8Int8Linear(weight, torch.bfloat16)
    assert torch.equal(in_bf16(x.bfloat16()), together.bfloat16())
    by_onednn = Int8Int8Linear(weight, torch.float16)  # (a float16 model's: never AMX's)
    assert not by_onednn.amx and torch.equal(by_onednn(x), together)
    # CUDA's path (torch._int_mm, rows padded past 16) computed here by torch's CPU _int_mm
    for rows in (1, 17, 40):
        assert torch.equal(_int8_cuda_matmul(x[:rows], q.t(), product.weight_scale,
                                             input_scale), together[:rows])
    assert product(x[:0]).shape == (0, 48)


@needs_int8_gemm
def test_a_compiled_forward_calls_the_int8_gemm_as_one_opaque_op():
    """--compile: the product is a custom op with a fake shape (fullgraph: no break)."""
    torch.manual_seed(0)
    product = Int8Int8Linear(QuantizedWeight(torch.randint(-127, 128, (32, 64), dtype=torch.int8),
                                             torch.rand(32, 1), None, 8, None, True))
    x = torch.randn(5, 64)
    compiled = torch.compile(lambda x: product(x) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), product(x) * 2)


@pytest.mark.skipif(not has_int4_gemm(), reason="int4_gemm is built for AVX512-BF16 CPUs")
@pytest.mark.parametrize("out_features, in_features, group, zero", [
    (48, 256, 32, False),   # an odd number of 16-output blocks; tiles where AMX is
    (64, 512, 128, True),   # zero points
    (32, 96, 16, True),     # a group shorter than a tile's depth: vector products
    (80, 192, -1, False)])  # per channel
def test_the_int4_gemm_is_its_dequantized_weights_product_row_by_row(out_features, in_features,
                                                                     group, zero):
    """Every row count (1, partial and whole tiles) within float32 summing of the
    dequantized product, each row the same bits alone as among others (exact speculation
    needs it); compiled, one opaque op."""
    torch.manual_seed(0)
    groups = 1 if group == -1 else in_features // group
    weight = QuantizedWeight(torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8),
                             torch.rand(out_features, groups) / 50,
                             torch.randint(-8, 8, (out_features, groups), dtype=torch.int8)
                             if zero else None, 4)
    product = cpu_kernel(weight, torch.bfloat16)
    assert isinstance(product, Int4GemmLinear)
    x = torch.randn(37, in_features).bfloat16()
    together = product(x)
    expected = x.double() @ weight.dequantized(torch.float64).t()
    assert (together.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
    alone = torch.cat([product(x[i:i + n]) for i, n in ((0, 1), (1, 16), (17, 20))])
    assert torch.equal(together, alone)
    compiled = torch.compile(lambda x: product(x) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x[:3]), together[:3] * 2)


@pytest.mark.parametrize("case", PACKED)
def test_a_gptq_or_awq_checkpoint_computes_its_dequantized_copy(base, tmp_path, case):
    write, options, kernel = PACKED[case]
    computes_its_reference(*write(base, tmp_path / case, **options), base, kernel)


def computes_its_reference(quantized, reference, base, kernel) -> None:
    """fp32: the quantized checkpoint's logits are its reference's; bf16: every linear on
    `kernel` (None: dequantized), no farther from the fp32 reference than bf16's dense
    path is."""
    ours, theirs = logits(quantized, PROMPT), logits(reference, PROMPT)
    assert (ours - theirs).abs().max().item() < 1e-4  # fp32: read exactly
    assert (ours - logits(base, PROMPT)).abs().max().item() > 1e-3  # it is quantized
    runner = ModelRunner(RunnerConfig(str(quantized), kv_cache_mb=8, dtype="bfloat16"))
    assert matmuls(runner) == {kernel}  # every linear on its kernel (None: dequantized)
    # bf16: the kernels no farther from the fp32 reference than bf16's dense path is
    dense_error = (logits(reference, PROMPT, "bfloat16") - theirs).abs().max().item()
    error = (logits(quantized, PROMPT, "bfloat16") - theirs).abs().max().item()
    assert error < 2 * dense_error + 1e-3, (error, dense_error)


@pytest.mark.slow
@pytest.mark.parametrize("scheme, group, runs", [
    ("W4A16", 32, (("bfloat16", 1), ("bfloat16", 2), ("float32", 2))),
    pytest.param("W8A8", None, (("bfloat16", 1), ("float32", 2)), marks=needs_int8_gemm)])
def test_speculation_over_a_quantized_target_is_its_greedy_output(base, tmp_path, scheme,
                                                                  group, runs):
    """The unquantized model drafts for its quantized self. In each dtype, alone and over
    two ranks, the output is the target's own greedy decoding on as many ranks (bf16
    partial sums reduced across ranks round differently from one rank's; W8A8's ranks
    scale their own shard of a row-parallel input). 4-bit in fp32 over two ranks, each
    cutting its shard of packed groups, is the greedy decoding of compressed-tensors'
    dequantized copy on one."""
    target = quantized_copy(base, tmp_path / scheme, scheme, group)
    reference = dequantized_copy(target, tmp_path / "reference")
    prompts = [PROMPT, PROMPT[3:], [9, 8, 7, 6, 5]]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    dequantized = [s.output_ids for s in SpeculativeDecoder(ModelRunner(RunnerConfig(
        str(reference), kv_cache_mb=8))).generate(prompts, greedy, 0)]
    for dtype, tp in runs:
        config = dict(kv_cache_mb=8, dtype=dtype)
        group = TPRunnerGroup(RunnerConfig(str(target), tp=tp, **config))
        try:
            alone = [s.output_ids for s in
                     SpeculativeDecoder(group.runner).generate(prompts, greedy, 0)]
            drafter = Drafter(ModelRunner(RunnerConfig(str(base), **config)))
            seqs = SpeculativeDecoder(group.runner, drafter).generate(prompts, greedy, gamma=4)
        finally:
            group.close()
        assert [s.output_ids for s in seqs] == alone, f"{dtype}, tp={tp}"
        assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
        if dtype == "float32" and scheme == "W4A16":
            assert alone == dequantized


def golden(variant: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(Path(__file__).parent / "data" / "gptq_awq_golden.safetensors")
    return {name.removeprefix(f"{variant}."): t for name, t in tensors.items()
            if name.startswith(f"{variant}.")}


def read_golden(variant: str) -> QuantizedWeight:
    fmt, bits = GOLDEN[variant]
    parts = {part: t for part, t in golden(variant).items() if part in FORMATS[fmt].parts}
    return FORMATS[fmt].read(parts, QuantScheme(variant, format=fmt, bits=bits))


@pytest.mark.parametrize("variant", GOLDEN)
def test_gptq_and_awq_read_as_their_writers_dequantize(variant):
    """The reader's weight is the writer's own dequantization (AutoGPTQ's, AutoAWQ's),
    and the tests' packer packs the writer's levels into its very words."""
    tensors = golden(variant)
    assert torch.equal(read_golden(variant).dequantized(torch.float32), tensors["dequantized"])
    levels, zeros = tensors["levels"], tensors["zeros"]
    fmt, bits = GOLDEN[variant]
    packed = (pack_gptq(levels, zeros, bits, zero_offset=1) if fmt == "gptq"
              else pack_awq(levels, zeros))
    assert torch.equal(packed[0], tensors["qweight"]) and torch.equal(packed[1], tensors["qzeros"])


@pytest.mark.parametrize("variant", ["gptq4_asym_act", "awq4"])
def test_each_rank_holds_its_shard_of_a_gptq_or_awq_weight(variant):
    """Over two ranks, column-parallel rows and row-parallel whole groups of columns
    (act-order's scattered ones too) of the weight as read."""
    weight = read_golden(variant)
    dense = weight.dequantized(torch.float32)  # [32, 32]
    for layer_type, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        shards = []
        for rank in range(2):
            layer = layer_type(32, 32, False, TPGroup(rank=rank, size=2))
            layer.weight_loader(layer.weight, weight)
            layer.settle_quantized()  # fp32: dequantized into layer.weight
            shards.append(layer.weight.data)
        assert torch.equal(torch.cat(shards, dim), dense), layer_type.__name__


def test_a_shard_that_cuts_quantization_groups_is_refused():
    layer = RowParallelLinear(128, 16, False, TPGroup(rank=1, size=4))  # 32 columns a rank
    weight = QuantizedWeight(torch.zeros(16, 128, dtype=torch.int8), torch.ones(16, 2), None,
                             4)  # groups of 64
    with pytest.raises(ValueError, match="cuts groups of 64"):
        layer.weight_loader(layer.weight, weight)


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, True), (torch.float32, False)])
def test_a_quantized_linear_allocates_no_dense_weight_unless_dequantized(dtype, kernel):
    """Built under linear_weights_deferred (a quantized checkpoint's model), a linear's
    dense weight exists only once a dense tensor or a dequantized one goes into it: in
    bf16 the 4-bit kernel takes the levels and it never does; in fp32 (no kernel) it holds
    the dequantized weight; a dense layer's tensor is stored as it comes."""
    with linear_weights_deferred():
        quantized, dense = (built_as(dtype, torch.device("cpu"), lambda bias=bias:
                                     ReplicatedLinear(128, 32, bias, TPGroup()))
                            for bias in (False, True))
    assert quantized.weight.is_meta and dense.weight.is_meta and not dense.bias.is_meta
    levels = QuantizedWeight(torch.randint(-8, 8, (32, 128), dtype=torch.int8),
                             torch.rand(32, 1) / 8, None, 4)
    quantized.weight_loader(quantized.weight, levels)
    quantized.settle_quantized()
    assert (quantized.quantized_matmul is not None) == kernel
    assert quantized.weight.is_meta == kernel
    if not kernel:
        assert torch.equal(quantized.weight, levels.dequantized(dtype))
    values = torch.randn(32, 128).to(dtype)
    dense.weight_loader(dense.weight, values)
    assert torch.equal(dense.weight, values)


@pytest.mark.parametrize("quantization, refused", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq, 4-bit int weights, group size 128, format gemv: version 'gemv' is not supported "
     r"\(only gemm\)"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"},
     r"8-bit weights are not supported \(only 4-bit\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "zero_point false is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False},
     r"gptq, 3-bit int weights, group size 128: 3-bit weights are not supported \(only 4 "
     r"and 8-bit\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
     "checkpoint format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128,
      "dynamic": {"-:.*down_proj.*": {}}}, "dynamic \\(per-module\\) overrides"),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
     r"fp8, e5m2 weights, dynamic activations: fmt 'e5m2' is not supported \(only e4m3\)"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]},
     r"weight_block_size \[128\] is not two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]},
     r"weight_block_size \[128, 0\] is not two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128.0, 128]},
     r"weight_block_size \[128.0, 128\] is not two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "none"},
     r"activation_scheme 'none' is not supported \(only dynamic, static\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "bitsandbytes checkpoints are not loaded yet"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 3, "type": "int"}}}},
     "3-bit int weights are not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}},
     "format 'nvfp4-pack-quantized' is not supported")])
def test_a_scheme_that_cannot_be_served_is_refused_naming_it(base, tmp_path, quantization,
                                                             refused):
    copy = quantized_copy(base, tmp_path / "q", "W4A16", 32)
    edit_config(copy, quantization_config=quantization)
    with pytest.raises(ModelConfigError, match=refused):
        ModelRunner(RunnerConfig(str(copy), kv_cache_mb=8))


def test_a_quantized_draft_does_not_learn_while_it_serves(base, tmp_path):
    from outrider.engine.distill import DistillConfig, Distiller

    draft = ModelRunner(RunnerConfig(str(quantized_copy(base, tmp_path / "q", "W4A16", 32)),
                                     kv_cache_mb=8))
    with pytest.raises(ValueError, match="a quantized draft cannot learn while it serves"):
        Distiller(draft, DistillConfig())


def test_a_quantized_module_missing_a_part_is_named(base, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = quantized_copy(base, tmp_path / "q", "W4A16", 32)
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_shape"]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="quantized module 'model.layers.1.mlp.down_proj' "
                                              "lacks its 'weight_shape' tensor"):
        ModelRunner(RunnerConfig(str(copy), kv_cache_mb=8))


def test_block_fp8_scales_cover_short_last_blocks():
    """A block-wise FP8 weight whose shape the 128 x 128 blocks do not divide (as
    compressed-tensors pads them): each weight takes its own block's scale."""
    weight = torch.randn(300, 200).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2) + 0.5
    dense = read_compressed_tensors({"weight": weight, "weight_scale": scale},
                                    QuantScheme("FP8 block", block=(128, 128)))
    for row, col in ((0, 0), (127, 127), (128, 128), (255, 199), (256, 0), (299, 199)):
        expected = weight[row, col].float() * scale[row // 128, col // 128]
        assert dense[row, col] == expected


def transformers_logits(model_dir, prompt: list[int], monkeypatch) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of transformers' model, whose FineGrainedFP8
    dequantizes an fp8 checkpoint as it loads on a CPU. It asks that accelerate be
    installed, which that path does not use."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # dequantized
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("case", FP8_CASES)
def test_an_fp8_checkpoint_computes_what_transformers_dequantizes(base, tmp_path, monkeypatch,
                                                                 case):
    """Ours reads a per-tensor scale as AutoFP8 and vLLM name it (weight_scale),
    transformers the same values as it names them (weight_scale_inv)."""
    ours = logits(fp8_copy(base, tmp_path / "ours", **FP8_CASES[case])[0], PROMPT)
    theirs_dir = fp8_copy(base, tmp_path / "theirs", scale_name="weight_scale_inv",
                          **FP8_CASES[case])[0]
    assert (ours - transformers_logits(theirs_dir, PROMPT, monkeypatch)).abs().max() < 1e-4
    assert (ours - logits(base, PROMPT)).abs().max() > 1e-3  # it is quantized


def test_fp8_short_blocks_compute_deepseeks_dequantization(base, tmp_path):
    """Blocks of 24 x 40 leave every weight's last ones short (64 rows: 24, 24, 16)."""
    quantized, reference = fp8_copy(base, tmp_path / "fp8", block=(24, 40))
    ours = logits(quantized, PROMPT)
    assert (ours - logits(reference, PROMPT)).abs().max() < 1e-4
    assert (ours - logits(base, PROMPT)).abs().max() > 1e-3


def test_fp8_modules_not_converted_stay_dense(base, tmp_path, monkeypatch):
    """modules_to_not_convert's lm_head and one down_proj, dense beside fp8 modules, as
    transformers reads them."""
    from safetensors.torch import load_file

    dense = ("lm_head", "model.layers.1.mlp.down_proj")
    quantized = fp8_copy(base, tmp_path / "fp8", block=(16, 16), not_converted=dense)[0]
    tensors = load_file(quantized / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    for module in dense:
        assert tensors[f"{module}.weight"].dtype == torch.float32
        assert f"{module}.weight_scale_inv" not in tensors
    theirs = transformers_logits(quantized, PROMPT, monkeypatch)
    assert (logits(quantized, PROMPT) - theirs).abs().max() < 1e-4


def test_fp8_block_scales_as_many_as_rows_are_blocks():
    """[2, 16] scales for [32, 256] in blocks of 16: as many as rows, and still blocks."""
    weight = (torch.randn(32, 256) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 16) + 0.5
    dense = read_fp8({"weight": weight, "weight_scale_inv": scale},
                     QuantScheme("fp8", block=(16, 16), format="fp8"))
    assert torch.equal(dense, fp8_dequantized(weight, scale, (16, 16)))


def test_fp8_tensors_the_config_does_not_describe_are_named(base, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = fp8_copy(base, tmp_path / "fp8", block=(16, 16))[0]
    edit_config(copy, quantization_config=dict(
        json.loads((copy / "config.json").read_text())["quantization_config"],
        weight_block_size=[32, 32]))
    with pytest.raises(CheckpointError, match=r"a weight scale of shape \(\d, \d\) for a "
                                              r"weight of \(\d+, \d+\): not one a tensor, a "
                                              r"channel or a block of 32 x 32"):
        ModelRunner(RunnerConfig(str(copy), kv_cache_mb=8))
    tensors = load_file(copy / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    save_file(tensors, copy / "model.safetensors")
    edit_config(copy, quantization_config=dict(
        json.loads((copy / "config.json").read_text())["quantization_config"],
        weight_block_size=[16, 16]))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj': weight is "
                                              "torch.float8_e5m2, not the float8_e4m3fn"):
        ModelRunner(RunnerConfig(str(copy), kv_cache_mb=8))


def test_a_quantized_routed_experts_checkpoint_is_refused(base, tmp_path):
    copy = fp8_copy(base, tmp_path / "fp8", block=(16, 16))[0]
    edit_config(copy, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ModelConfigError, match=r"\(e4m3 weights, weight_block_size \[16, 16\], "
                                               r"dynamic activations\) of routed experts "
                                               r"\(Qwen3MoeForCausalLM\) cannot be served yet"):
        ModelRunner(RunnerConfig(str(copy), kv_cache_mb=8))


def test_fp8_on_load_computes_compressed_tensors_fp8_per_tensor(base, tmp_path):
    """vLLM's `--quantization fp8` of an unquantized checkpoint (e4m3 weights, one scale a
    tensor) computes what compressed-tensors' FP8 scheme writes of the same checkpoint;
    and the quantization took place (the logits moved from the float model's)."""
    written = quantized_copy(base, tmp_path / "fp8", "FP8")
    on_load = logits(base, PROMPT, quantization="fp8")
    assert torch.allclose(on_load, logits(written, PROMPT), atol=1e-4)
    assert not torch.allclose(on_load, logits(base, PROMPT), atol=1e-3)


def test_only_fp8_quantizes_an_unquantized_checkpoint_as_it_loads(base, tmp_path):
    assert ModelConfig.from_dir(base, "fp8").quantization.on_load
    assert ModelConfig.from_dir(base).quantization is None
    with pytest.raises(ModelConfigError, match="quantized as it loads by fp8 only"):
        ModelConfig.from_dir(base, "gptq")
    moe = tmp_path / "moe"
    moe.mkdir()
    config = json.loads((base / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps(dict(config,
                                                     architectures=["Qwen3MoeForCausalLM"])))
    with pytest.raises(ModelConfigError, match="of routed experts"):
        ModelConfig.from_dir(moe, "fp8")


def test_fp8_tensor_cores_product_of_rows_each_by_its_own_scale():
    """Fp8Linear, what a GPU with FP8 tensor cores runs (torch._scaled_mm; here torch's
    CPU reference of it): each row of x quantized by its own scale, so a row's output is
    the same alone and in a batch (a zero row too), and equals the product of the
    dequantized FP8 rows and weight."""
    torch.manual_seed(0)
    weight = fp8_on_load(torch.randn(32, 64) * 0.05)
    linear = Fp8Linear(weight, torch.device("cpu"))
    x = (torch.randn(4, 64) * torch.tensor([[1.0], [30.0], [0.01], [0.0]])).bfloat16()
    out = linear(x)  # [4, 32]
    levels, scale = fp8_rows(x)
    reference = (levels.float() * scale) @ weight.dequantized(torch.float32).t()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, rtol=1e-2, atol=1e-6)
    for row in range(4):
        assert torch.equal(linear(x[row:row + 1]), out[row:row + 1])
    exact = x.float() @ weight.dequantized(torch.float32).t()  # FP8 rows: 3 mantissa bits
    assert (out.float() - exact).norm() <= 0.1 * exact.norm()


def test_fp8_on_load_quantizes_the_target_and_not_its_draft(base):
    """--quantization is the target's (vLLM's: a draft's own is in --speculative-config):
    a draft model in the same process loads as its checkpoint is."""
    from outrider.engine.local import LocalEngine, LocalEngineConfig

    target = RunnerConfig(str(base), kv_cache_mb=8, quantization="fp8")
    with LocalEngine(LocalEngineConfig(target, str(base), draft_kv_cache_mb=8)) as engine:
        assert engine.decoder.target.model_config.quantization.on_load
        assert engine.decoder.drafter.model.runner.model_config.quantization is None
