"""Draft replica: proposes tokens for many sequences at once (issue 4)."""
