"""A draft replica: drafts tokens for many sequences at once, keeping each sequence's
KV cache between rounds."""
