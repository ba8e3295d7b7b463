"""What a test needs of the machine beyond Python. A C++ compiler builds the CPU kernels
(outrider/engine/kernels) and inductor's CPU code (--compile); without one the engine
runs the reference path eagerly (one log line says so), and the tests of those builds
skip, saying why, instead of passing on the path they are not about."""

from __future__ import annotations

import os
import shutil

import pytest

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None

needs_compiler = pytest.mark.skipif(
    not HAS_COMPILER, reason="no C++ compiler ($CXX, else c++): the CPU kernels and "
                             "--compile's code cannot be built on this machine")
