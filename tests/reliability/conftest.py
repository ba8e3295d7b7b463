"""Fixtures of the reliability suite: checkpoints with a long context, so a
request outlives a worker restart."""

from __future__ import annotations

import pytest

from tests.checkpoints import perturbed_copy, save_random_checkpoint


@pytest.fixture(scope="session")
def long_target_dir(tmp_path_factory, tokenizer_dir):
    """The session's small Llama shape with a 4,096-token context."""
    return save_random_checkpoint(tmp_path_factory.mktemp("long_target"), "llama",
                                  tokenizer_from=tokenizer_dir, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def long_draft_dir(tmp_path_factory, long_target_dir):
    return perturbed_copy(long_target_dir, tmp_path_factory.mktemp("long_draft"), noise=0.1)
