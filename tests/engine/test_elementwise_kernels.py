"""The C++ elementwise steps (RMSNorm with the residual added in place, SiLU·up, RoPE in
place, W8A8's row quantization and scaling) against the torch path the model runs
without them, in float32 and bfloat16, at widths that are and are not a multiple of
their 16-lane vectors; and a forward with them against one without."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.kernels import cpu_kernels_loaded, use_cpu_kernels
from outrider.engine.model import RMSNorm
from outrider.engine.quant.weight import _quantized_rows
from outrider.engine.rope import RotaryEmbedding, apply_rope
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from tests.toolchain import needs_compiler

pytestmark = needs_compiler  # every test compares the kernels with the torch path

ULP = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # relative: the last place, and a bit


@pytest.fixture(autouse=True)
def kernels_built():
    """A compiler is here (needs_compiler): a failed build must fail these tests, not
    leave them comparing the torch path with itself."""
    assert cpu_kernels_loaded(), "the CPU kernels did not build (see the log line)"


@pytest.fixture
def torch_path():
    """Run a block on the torch path, then back to the kernels."""
    use_cpu_kernels(False)
    yield
    use_cpu_kernels(True)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [320, 40])
@pytest.mark.parametrize("rows", [7, 450])  # 450 x 320: rows split over several tasks
def test_rms_norm_and_the_residual_added_in_place(dtype, hidden, rows):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(hidden) + 0.5).to(dtype)
    x, residual = (torch.randn(rows, hidden).to(dtype) * 3 for _ in range(2))
    with torch.inference_mode():
        plain = norm(x)
        added, summed = norm.add_and_norm(x, residual.clone())
        use_cpu_kernels(False)
        try:
            want_plain = norm(x)
            want_added, want_sum = norm.add_and_norm(x, residual.clone())
        finally:
            use_cpu_kernels(True)
    close(plain, want_plain, dtype)
    assert torch.equal(summed, want_sum)  # the stream rounds as the torch path stores it
    close(added, want_added, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [864, 24])
@pytest.mark.parametrize("rows", [9, 200])  # 200 x 864: rows split over several tasks
def test_silu_times_up(dtype, inner, rows):
    gate_up = torch.randn(rows, 2 * inner).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate.float()) * up.float())
    close(torch.ops.outrider_cpu.silu_mul(gate_up), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_in_place_on_queries_and_keys_of_one_buffer(dtype, head_dim):
    """Rotated in place in the first heads of a qkv buffer, the values' heads untouched."""
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 300, 301, 511])
    qkv = torch.randn(len(positions), 5 + 2 * 2, head_dim).to(dtype)
    cos_sin = rope.lookup(positions, dtype)
    want = apply_rope(qkv[:, :7].float(), tuple(t.float() for t in cos_sin))
    values = qkv[:, 7:].clone()
    torch.ops.outrider_cpu.rope_(qkv[:, :7], *cos_sin)
    close(qkv[:, :7], want, dtype)
    assert torch.equal(qkv[:, 7:], values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static_scale", [None, 0.013, 1.0])
def test_w8a8_inputs_quantized_and_sums_scaled_as_the_torch_path_to_the_bit(dtype,
                                                                          static_scale):
    """Bit for bit, or a sequence's W8A8 output would depend on which path ran it (a zero
    row, values past the static scale's range, halves rounded to even and width 1,000
    included)."""
    torch.manual_seed(0)
    x = (torch.randn(37, 1000) * 3).to(dtype)
    x[3] = 0
    x[4, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.5, 130.0])  # ties (scale 1)
    for rows in (x, x[:, 8:900], x[5:6]):  # whole, strided rows, one row
        levels, scale = torch.ops.outrider_cpu.quantize_rows(rows, static_scale)
        want_levels, want_scale = _quantized_rows(rows, static_scale)
        assert torch.equal(levels, want_levels) and torch.equal(scale, want_scale)
    _, scale = _quantized_rows(x, static_scale)  # [37, 1]
    sums = torch.randn(37, 300) * 1e3
    assert torch.equal(torch.ops.outrider_cpu.scale_rows(sums, scale, x),
                       (sums * scale).to(dtype))


def forward_logits(model_dir, dtype: str, kernels: bool) -> torch.Tensor:
    use_cpu_kernels(kernels)
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype=dtype, kv_cache_mb=2))
    runner.blocks.append(0, 40)
    return runner.forward([ForwardRequest(list(range(3, 43)), 0, runner.blocks.block_table(0),
                                          40)])


def test_a_float32_forward_with_the_kernels_is_the_torch_paths(llama_dir, torch_path):
    with_kernels = forward_logits(llama_dir, "float32", True)
    torch.testing.assert_close(with_kernels, forward_logits(llama_dir, "float32", False),
                               rtol=1e-4, atol=1e-4)


def test_a_bfloat16_forward_with_the_kernels_is_as_close_to_float32(llama_dir, torch_path):
    """Both bf16 paths round differently (the kernels compute each step in fp32 and round
    once); the kernels' is no further from the fp32 forward than the torch path's."""
    exact = forward_logits(llama_dir, "float32", False)
    errors = {kernels: (forward_logits(llama_dir, "bfloat16", kernels) - exact).abs().mean()
              for kernels in (True, False)}
    assert errors[True] <= errors[False] * 1.1, errors
