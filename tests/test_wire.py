"""The q payload codec refuses what cannot be an exact proposal."""

from __future__ import annotations

import pytest
import torch

from outrider.core.sampling import SamplingParams, sampling_from_proto
from outrider.v1 import worker_pb2 as pb
from outrider.wire import WireError, decode_q, encode_proposal

VOCAB = 6


def test_round_trip_sparse_and_fp16():
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0.25, 0.75, 0, 0, 0]])
    for fmt in ("sparse", "dense_fp16"):
        msg = encode_proposal("s", [0, 2], q, fmt)
        torch.testing.assert_close(decode_q(msg, fmt, VOCAB), q)


@pytest.mark.parametrize("fmt", ["sparse", "dense_fp16"])
def test_a_draft_token_outside_q_support_is_refused(fmt):
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]])
    msg = encode_proposal("s", [3], q, fmt)  # token 3 has q = 0
    with pytest.raises(WireError, match="support"):
        decode_q(msg, fmt, VOCAB)


def test_negative_or_nan_q_is_refused():
    msg = pb.Proposal(seq_id="s", token_ids=[1], support_lens=[2], support_ids=[0, 1],
                      support_probs=[float("nan"), 0.5])
    with pytest.raises(WireError):
        decode_q(msg, "sparse", VOCAB)


def test_unset_seed_stays_unset():
    params, seed = sampling_from_proto(pb.Sampling(temperature=0.8))
    assert seed is None and params.seed is None
    params, seed = sampling_from_proto(pb.Sampling(temperature=0.8, seed=0))
    assert seed == 0 and params.seed == 0
    assert SamplingParams(temperature=0.8).seed is None


def test_a_draft_replica_learns_what_ends_the_output():
    """EOS unless the request ignores it, and the stop ids: the draft holds them back
    under min_tokens and stops a row after one (docs/DESIGN.md §2.6)."""
    from outrider.core.sampling import sampling_to_proto

    sent = SamplingParams(stop_token_ids=(7, 9), eos_token_ids=(0,))
    drafts_with, _ = sampling_from_proto(sampling_to_proto(sent, seed=1))
    assert drafts_with.held_back_ids == (0, 7, 9)
    ignoring = SamplingParams(stop_token_ids=(7,), eos_token_ids=(0,), ignore_eos=True)
    drafts_with, _ = sampling_from_proto(sampling_to_proto(ignoring, seed=1))
    assert drafts_with.held_back_ids == (7,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_heads_features_cross_the_wire_as_they_are_or_are_refused_by_name(dtype):
    from outrider.wire import decode_features, encode_features

    rows = torch.randn(3, 8).to(dtype)
    msg = encode_features(rows)
    assert torch.equal(decode_features(msg, 3, 8, "sequences['s']"), rows)
    for num_rows, width, says in ((4, 8, "has 48 bytes" if dtype != torch.float32
                                   else "has 96 bytes"), (3, 24, "width is 8")):
        with pytest.raises(WireError, match=says):
            decode_features(msg, num_rows, width, "sequences['s']")
    msg.data = torch.full((3, 8), float("nan"), dtype=dtype).view(torch.uint8).numpy().tobytes()
    with pytest.raises(WireError, match="not finite"):
        decode_features(msg, 3, 8, "sequences['s']")
