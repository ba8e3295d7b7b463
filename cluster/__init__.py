"""Ray control plane: placement, supervision, scaling (issue 6)."""
