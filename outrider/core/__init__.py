"""The torch-free core the router, the target replica and the SDK share: sampling
parameters (`sampling`), the γ policy (`policy`), acceptance statistics (`stats`) and
what a checkpoint's config.json says (`hf_config`)."""
