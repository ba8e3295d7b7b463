"""Target replica: continuous-batching scheduler and verification (issue 4)."""
