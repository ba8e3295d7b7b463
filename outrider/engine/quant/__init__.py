"""Quantized checkpoints: what their quantization_config says (scheme.py), their tensors
read into one form (formats.py), and the matmul a layer then runs (weight.py). The
parallel linears hold a QuantizedWeight where a dense one would be (parallel.py)."""
