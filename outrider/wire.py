"""Conversions between engine objects and the wire messages of protos/outrider/v1.

The q payload codec lives here once, for the draft replica that encodes and the target
replica that decodes (docs/DESIGN.md §3: ids only, point mass, sparse support, dense fp16).
"""

from __future__ import annotations

import numpy as np
import torch

from outrider.core.sampling import SamplingParams
from outrider.v1 import worker_pb2 as pb

Q_FORMAT_NAMES = {pb.Q_FORMAT_IDS: "ids", pb.Q_FORMAT_POINT_MASS: "point_mass",
                  pb.Q_FORMAT_SPARSE: "sparse", pb.Q_FORMAT_DENSE_FP16: "dense_fp16",
                  pb.Q_FORMAT_DENSE_DIST: "dense_dist"}
Q_FORMAT_CODES = {name: code for code, name in Q_FORMAT_NAMES.items()}


class WireError(ValueError):
    """A message that cannot be what its sender meant; the text names the field."""


def q_format_for(params: SamplingParams, has_dense_channel: bool = False) -> str:
    """The cheapest exact q format for a request (docs/DESIGN.md §3)."""
    if params.is_greedy:
        return "ids"
    if params.top_k or params.top_p < 1:
        return "sparse"
    return "dense_dist" if has_dense_channel else "dense_fp16"


def encode_proposal(seq_id: str, token_ids: list[int], q_rows: torch.Tensor | None,
                    q_format: str) -> pb.Proposal:
    """q_rows: [gamma, vocab], the rows the draft sampled from (None for point masses:
    the ids say it all)."""
    msg = pb.Proposal(seq_id=seq_id, token_ids=token_ids)
    if q_rows is None or q_format in ("ids", "point_mass"):
        return msg
    msg.vocab_size = q_rows.shape[-1]
    if q_format == "sparse":
        for row in q_rows:
            support = row.nonzero().squeeze(-1)
            msg.support_lens.append(len(support))
            msg.support_ids.extend(support.tolist())
            msg.support_probs.extend(row[support].tolist())
    elif q_format == "dense_fp16":
        msg.dense_q = q_rows.half().cpu().numpy().astype("<f2").tobytes()
    return msg


def decode_q(msg: pb.Proposal, q_format: str, vocab: int) -> torch.Tensor:
    """Dense, normalised q [gamma, vocab] from a proposal."""
    ids = torch.tensor(checked_ids(msg, vocab), dtype=torch.long)
    gamma = len(ids)
    if q_format in ("ids", "point_mass"):
        return torch.nn.functional.one_hot(ids, vocab).float()
    if q_format == "sparse":
        q = _sparse_rows(msg, gamma, vocab)
    elif q_format == "dense_fp16":
        if len(msg.dense_q) != gamma * vocab * 2:
            raise WireError(f"proposal {msg.seq_id}: dense_q has {len(msg.dense_q)} bytes, "
                            f"expected {gamma * vocab * 2}")
        q = torch.from_numpy(np.frombuffer(msg.dense_q, dtype="<f2").astype(np.float32))
        q = q.view(gamma, vocab)
    else:
        raise WireError(f"unknown q format {q_format!r}")
    return checked_q(q, ids, msg.seq_id)


def checked_ids(msg: pb.Proposal, vocab: int) -> list[int]:
    """The proposal's draft tokens, refused when one is outside the vocabulary."""
    ids = list(msg.token_ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise WireError(f"proposal {msg.seq_id}: token_ids outside the vocabulary [0, {vocab})")
    return ids


def checked_q(q: torch.Tensor, token_ids: torch.Tensor, seq_id: str) -> torch.Tensor:
    """Normalised q [gamma, vocab], refusing rows that cannot be what the draft sampled
    from: the acceptance test u * q(x) < p(x) is only exact when q(x) > 0."""
    is_valid = bool(torch.isfinite(q).all()) and bool((q >= 0).all())
    if not is_valid or (len(token_ids) and
                        bool((q.gather(-1, token_ids[:, None]) <= 0).any())):
        raise WireError(f"proposal {seq_id}: q is not a distribution with its draft tokens "
                        "in the support")
    return q / q.sum(-1, keepdim=True)


def _sparse_rows(msg: pb.Proposal, gamma: int, vocab: int) -> torch.Tensor:
    lens = list(msg.support_lens)
    if (len(lens) != gamma or sum(lens) != len(msg.support_ids)
            or len(msg.support_ids) != len(msg.support_probs)):
        raise WireError(f"proposal {msg.seq_id}: support_lens/support_ids/support_probs "
                        "do not describe one support per draft token")
    q = torch.zeros(gamma, vocab)
    ids = torch.tensor(list(msg.support_ids), dtype=torch.long)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise WireError(f"proposal {msg.seq_id}: support_ids outside the vocabulary")
    rows = torch.repeat_interleave(torch.arange(gamma), torch.tensor(lens, dtype=torch.long))
    q[rows, ids] = torch.tensor(list(msg.support_probs), dtype=torch.float32)
    return q


FEATURE_DTYPES = {pb.FEATURE_DTYPE_FP32: torch.float32, pb.FEATURE_DTYPE_BF16: torch.bfloat16,
                  pb.FEATURE_DTYPE_FP16: torch.float16}
FEATURE_DTYPE_CODES = {dtype: code for code, dtype in FEATURE_DTYPES.items()}


def encode_features(rows: torch.Tensor) -> pb.Features:
    """A head's input rows [n, width] as they are (bf16 stays bf16); any other dtype
    goes as fp32."""
    rows = rows.detach()
    if rows.dtype not in FEATURE_DTYPE_CODES:
        rows = rows.float()
    raw = rows.contiguous().cpu().view(torch.uint8).numpy().tobytes()  # little-endian hosts
    return pb.Features(data=raw, width=rows.shape[-1], dtype=FEATURE_DTYPE_CODES[rows.dtype])


def decode_features(msg: pb.Features, num_rows: int, width: int,
                    where: str) -> torch.Tensor:
    """[num_rows, width] from the wire, refused unless it is num_rows rows of `width`
    (what the head reads) in a known dtype."""
    dtype = FEATURE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}.features.dtype is not set")
    if msg.width != width:
        raise WireError(f"{where}.features.width is {msg.width}; the head reads {width}")
    expected = num_rows * msg.width * dtype.itemsize
    if len(msg.data) != expected:
        raise WireError(f"{where}.features.data has {len(msg.data)} bytes, expected "
                        f"{expected} ({num_rows} rows of {msg.width} {dtype})")
    if not num_rows:
        return torch.zeros(0, msg.width, dtype=dtype)
    rows = torch.frombuffer(bytearray(msg.data), dtype=dtype).view(num_rows, msg.width)
    if not bool(torch.isfinite(rows).all()):
        raise WireError(f"{where}.features holds values that are not finite")
    return rows
