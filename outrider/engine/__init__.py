"""Model runtime: Llama-family models, tensor parallelism, paged KV cache, sampling and
exact speculative verification."""
