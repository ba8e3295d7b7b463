"""Conversions between engine objects and the wire messages of protos/outrider/v1.

The q payload codec lives here once, for the draft replica that encodes and the target
replica that decodes (DESIGN §3: ids only, point mass, sparse support, dense fp16).
"""

from __future__ import annotations

import numpy as np
import torch

from outrider.engine.sampling import SamplingParams, TokenLogprob
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import worker_pb2 as pb

Q_FORMAT_NAMES = {pb.Q_FORMAT_IDS: "ids", pb.Q_FORMAT_POINT_MASS: "point_mass",
                  pb.Q_FORMAT_SPARSE: "sparse", pb.Q_FORMAT_DENSE_FP16: "dense_fp16",
                  pb.Q_FORMAT_DENSE_DIST: "dense_dist"}
Q_FORMAT_CODES = {name: code for code, name in Q_FORMAT_NAMES.items()}


class WireError(ValueError):
    """A message that cannot be what its sender meant; the text names the field."""


def sampling_to_proto(params: SamplingParams, seed: int | None) -> pb.Sampling:
    return pb.Sampling(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        held_back_ids=params.held_back_ids if params.min_tokens else ())


def sampling_from_proto(msg: pb.Sampling, **fields) -> tuple[SamplingParams, int | None]:
    """SamplingParams (validated: raises SamplingError naming the field) and the seed
    (None when the sender left it unset). Without stop_token_ids in `fields` (a draft
    replica), the held-back ids stand in for them: min_tokens is all they are for."""
    seed = msg.seed if msg.HasField("seed") else None
    if "stop_token_ids" not in fields:  # a draft replica: it never stops a sequence
        fields.update(stop_token_ids=tuple(msg.held_back_ids),
                      max_tokens=max(SamplingParams.max_tokens, msg.min_tokens))
    params = SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, seed=seed,
        min_p=msg.min_p, repetition_penalty=msg.repetition_penalty or 1.0,
        frequency_penalty=msg.frequency_penalty, presence_penalty=msg.presence_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())), min_tokens=msg.min_tokens, **fields)
    return params, seed


def logprobs_to_proto(logprobs: list[TokenLogprob]) -> list[gp.TokenLogprob]:
    return [gp.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs]


def q_format_for(params: SamplingParams, has_dense_channel: bool = False) -> str:
    """The cheapest exact q format for a request (DESIGN §3)."""
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
