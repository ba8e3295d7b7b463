"""`python -m outrider.engine.kernels`: build the CPU kernels now (what `make setup` does)."""

import logging

from outrider.engine.kernels import cpu_kernels_loaded

logging.basicConfig(level=logging.INFO, format="%(message)s")
print("CPU kernels:", "ready" if cpu_kernels_loaded() else "unavailable (see above)")
