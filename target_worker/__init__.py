"""A target replica: the continuous-batching engine loop that chooses γ, asks the draft
replicas for drafts, verifies them in one forward and streams each step to the routers."""
