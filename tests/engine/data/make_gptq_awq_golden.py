"""Writes gptq_awq_golden.safetensors: small linears packed by AutoGPTQ 0.7.1 and
AutoAWQ 0.2.9 themselves, with each writer's own dequantization of what it packed: the
reference tests/engine/test_quantized.py holds the readers (quant/formats.py) and the
tests' packers (tests/checkpoints.py) to. Not run by the tests: it needs the writers, no
dependency of this project (run once in a venv of its own: torch 2.13 CPU, then
auto-gptq and autoawq --no-deps, transformers, accelerate).

    python tests/engine/data/make_gptq_awq_golden.py

Per variant V: V.qweight, V.qzeros, V.scales (fp16) and V.g_idx (GPTQ) as the writer
saves them; V.levels [out, in] and V.zeros [out, groups], the unsigned levels packed; and
V.dequantized [out, in] fp32, the weight the writer's own forward (AutoGPTQ's torch path)
or dequantize_gemm (AutoAWQ) computes from the packed tensors. The weights handed to the
writers are exactly (levels - zeros) * scales, so their rounding picks those levels."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT, IN, GROUP = 32, 32, 8  # AutoGPTQ packs whole 32-feature words only
# variant -> (bits, group size (-1: per channel), symmetric, act-order)
GPTQ = {"gptq4_sym": (4, GROUP, True, False), "gptq4_asym_act": (4, GROUP, False, True),
        "gptq8_asym_channel": (8, -1, False, False), "gptq8_sym": (8, GROUP, True, False)}


def random_levels(bits: int, groups: int, sym: bool):
    """[out, in] levels, [out, groups] zero points (v1's offset needs them >= 1) and
    fp16-exact scales."""
    levels = torch.randint(0, 2 ** bits, (OUT, IN))
    zeros = (torch.full((OUT, groups), 2 ** (bits - 1)) if sym
             else torch.randint(1, 2 ** bits, (OUT, groups)))
    scales = (torch.rand(OUT, groups) * 0.02 + 0.002).half().float()
    return levels, zeros, scales


def gptq_variant(bits: int, group: int, sym: bool, act: bool) -> dict[str, torch.Tensor]:
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear

    size = IN if group == -1 else group
    order = torch.randperm(IN) if act else torch.arange(IN)  # act-order's column order
    g_idx = torch.empty(IN, dtype=torch.int32)
    g_idx[order] = torch.arange(IN, dtype=torch.int32) // size
    levels, zeros, scales = random_levels(bits, IN // size, sym)
    linear = torch.nn.Linear(IN, OUT, bias=False)
    linear.weight.data = (levels - zeros[:, g_idx.long()]) * scales[:, g_idx.long()]
    layer = QuantLinear(bits, group, IN, OUT, bias=False)
    layer.pack(linear, scales, zeros.clone(), g_idx)
    packed = {"qweight": layer.qweight, "qzeros": layer.qzeros, "g_idx": layer.g_idx,
              "scales": layer.scales.half()}
    layer.scales = layer.scales.float()
    dequantized = layer(torch.eye(IN)).t()  # x @ w.T with x = I: w.T
    return packed | {"dequantized": dequantized, "levels": levels.to(torch.uint8),
                     "zeros": zeros.to(torch.uint8)}


def awq_variant() -> dict[str, torch.Tensor]:
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    levels, zeros, scales = random_levels(4, IN // GROUP, sym=False)
    groups = torch.arange(IN) // GROUP
    linear = torch.nn.Linear(IN, OUT, bias=False)
    linear.weight.data = (levels - zeros[:, groups]) * scales[:, groups]
    # as AutoAWQ's quantizer hands them over for its GEMM layout: [groups, out]
    layer = WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scales.t().contiguous(),
                                      zeros=zeros.t().contiguous())
    dequantized = dequantize_gemm(layer.qweight, layer.qzeros, layer.scales.float(), 4, GROUP)
    return {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales,
            "dequantized": dequantized.t(), "levels": levels.to(torch.uint8),
            "zeros": zeros.to(torch.uint8)}


def _submodules_only(package: str) -> None:
    """Import `package`'s modules without its __init__ (AutoGPTQ's needs an older
    transformers; AutoAWQ's calibration needs `datasets`, unused here)."""
    module = types.ModuleType(package)
    module.__path__ = list(importlib.util.find_spec(package).submodule_search_locations)
    sys.modules[package] = module


def main() -> None:
    _submodules_only("auto_gptq")
    sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))
    torch.manual_seed(0)
    variants = {name: gptq_variant(*spec) for name, spec in GPTQ.items()}
    variants["awq4"] = awq_variant()
    save_file({f"{v}.{part}": t.contiguous() for v, tensors in variants.items()
               for part, t in tensors.items()},
              Path(__file__).with_name("gptq_awq_golden.safetensors"))


if __name__ == "__main__":
    main()
