"""What a test needs of the machine beyond Python. A C++ compiler builds the CPU kernels
(outrider/engine/kernels) and inductor's CPU code (--compile); without one the engine
runs the reference path eagerly (one log line says so), and the tests of those builds
skip, saying why, instead of passing on the path they are not about."""

from __future__ import annotations

import os
import shutil

import pytest

from outrider.engine.quant.weight import has_int8_gemm

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None

needs_compiler = pytest.mark.skipif(
    not HAS_COMPILER, reason="no C++ compiler ($CXX, else c++): the CPU kernels and "
                             "--compile's code cannot be built on this machine")

# W8A8's int8 GEMM needs an int8 dot product instruction (VNNI, AMX): elsewhere it runs
# weight-only, and nothing of it can be held to its reference
needs_int8_gemm = pytest.mark.skipif(
    not has_int8_gemm(), reason="no exact int8 GEMM on this CPU (an int8 dot product: VNNI or AMX)")
