"""Per-request sampling: parameters, logits processing, and position-keyed randomness.

Every distribution the engine samples from or verifies against comes from
`processed_logits`, for draft and target alike: p and q are the distributions after the
request's processors, temperature and truncation. Greedy is the point mass on the argmax
of the processed logits, so greedy and sampled requests share one verification path.

The processors, in vLLM's order: the grammar's mask (structured outputs), logit_bias and
min_tokens, then the repetition, frequency and presence penalties, then temperature (1 for
greedy), then min_p, top-k and top-p. The penalties look at the tokens before the row:
prompt + output for the repetition penalty, output only for frequency and presence; the
grammar's mask is that of the state after them. In a speculative round the output before
row j includes the round's draft tokens 0..j-1, on the draft and on the target alike, so
p and q are each the distribution of the token at that position given that history, and
rejection sampling stays exact.

Randomness is a pure function of (seed, absolute position, purpose): output does not
depend on batch composition, on how many tokens a round accepted, or on which replica
ran the round, so a request can be resumed elsewhere and reproduce the same tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from outrider.core.sampling import History, SamplingParams, TokenLogprob

# -- logits processing --------------------------------------------------------------------------

def processed_logits(logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[History] | None = None) -> torch.Tensor:
    """logits: [num_rows, vocab] fp32, one SamplingParams (and History, for processors
    that read it) per row -> the logits each row's token is chosen from: after the
    processors, divided by the temperature (1 for greedy), and -inf outside min_p /
    top-k / top-p for sampled rows. Returns `logits` itself when nothing changes it."""
    is_copy = any(p.changes_logits for p in params)
    if is_copy:
        logits = _apply_processors(logits.clone(), params, histories)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return logits
    rows = torch.tensor(sampled, device=logits.device)
    temperature = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
    every_row = len(sampled) == len(params)
    scaled = (logits if every_row else logits[rows]) / temperature[:, None]
    truncating = [params[i] for i in sampled]
    if any(p.truncates for p in truncating):
        scaled = _truncate(scaled, truncating)
    if every_row:
        return scaled
    logits = logits if is_copy else logits.clone()
    logits[rows] = scaled
    return logits


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[History] | None = None) -> torch.Tensor:
    """[num_rows, vocab] fp32 -> the distribution each row's token is drawn from."""
    return probs_of(processed_logits(logits, params, histories), params)


def probs_of(processed: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Processed logits -> probs [num_rows, vocab]: the point mass on the argmax for
    greedy rows (decided from the parameters, not from a rounded tensor), softmax else."""
    is_greedy = torch.tensor([p.is_greedy for p in params], device=processed.device)
    if bool(is_greedy.all()):
        return torch.zeros_like(processed).scatter_(-1, processed.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(processed, dim=-1)
    if bool(is_greedy.any()):
        rows = is_greedy.nonzero().squeeze(-1)
        probs[rows] = 0.0
        probs[rows, processed[rows].argmax(-1)] = 1.0
    return probs


def _apply_processors(logits: torch.Tensor, params: list[SamplingParams],
                      histories: list[History] | None) -> torch.Tensor:
    """The grammar's mask, logit_bias, min_tokens, then the penalties, in place;
    logits: [num_rows, vocab]."""
    vocab, device = logits.shape[-1], logits.device
    if histories is not None:
        _mask_grammar(logits, histories)
    bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if bias:
        rows, ids, values = zip(*bias)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device),
                          accumulate=True)
    if not any(p.reads_history for p in params):
        return logits
    if histories is None:
        raise ValueError("penalties and min_tokens need the history of each row")
    held = [(row, t) for row, (p, h) in enumerate(zip(params, histories))
            if _holds_back(p, h) for t in p.held_back_ids if t < vocab]
    if held:
        rows, ids = zip(*held)
        logits[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = -math.inf
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty]
    if rows:
        _penalize(logits, rows, params, [histories[i] for i in rows])
    return logits


def _holds_back(params: SamplingParams, history: History) -> bool:
    """min_tokens holds the ending tokens back, but not on a row whose grammar allows
    nothing else: the constraint is complete, and a valid output must end there (held
    back, no token would be left to choose)."""
    if history.num_output >= params.min_tokens:
        return False
    if history.allowed is None:
        return True
    allowed = np.unpackbits(history.allowed.view(np.uint8), bitorder="little").nonzero()[0]
    return bool(np.isin(allowed, params.held_back_ids, invert=True).any())


def _mask_grammar(logits: torch.Tensor, histories: list[History]) -> None:
    """-inf, in place, for the tokens each constrained row's grammar does not allow next
    (History.allowed, computed by outrider/core/grammar.py over the same tokens)."""
    rows = [i for i, h in enumerate(histories) if h.allowed is not None]
    if not rows:
        return
    packed = np.stack([histories[i].allowed for i in rows]).view(np.uint8)  # [n, words*4]
    bias = torch.nn.functional.embedding(  # [n, words*32]: each byte's 8 tokens at once
        torch.from_numpy(packed.astype(np.int64)), _BYTE_BIAS).reshape(len(rows), -1)
    vocab = logits.shape[-1]
    if bias.shape[-1] < vocab:  # ids past the grammar's vocabulary are never allowed
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[-1]), value=-math.inf)
    bias = bias[:, :vocab].to(logits.device)
    if len(rows) == len(histories):
        logits.add_(bias)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index] + bias


# 0 (allowed) or -inf for each of a byte's 8 tokens, by the byte's value [256, 8]: a
# packed mask becomes an additive bias through one lookup; a masked_fill over the
# vocabulary cost ~7x as much on CPU (it branches per element)
_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(torch.from_numpy(np.unpackbits(
    np.arange(256, dtype=np.uint8)[:, None], axis=-1, bitorder="little") == 0), -math.inf)


def _penalize(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              histories: list[History]) -> None:
    """In place, on the tokens each row has seen (few, next to the vocabulary): the
    repetition penalty divides the positive logits and multiplies the negative ones of
    every token in the prompt or the output; frequency and presence then subtract for
    the output's tokens. histories: one per entry of `rows`."""
    entry_row, token_ids, counts = _seen_tokens(histories, logits.shape[-1])  # [seen] each
    device, vocab = logits.device, logits.shape[-1]
    flat = logits.view(-1)  # one flat index per entry (mostly in order: few cache misses)
    at = (torch.tensor(rows)[entry_row] * vocab + token_ids).to(device)

    def per_entry(name: str) -> torch.Tensor:  # [seen]
        values = [getattr(params[r], name) for r in rows]
        return torch.tensor(values, dtype=logits.dtype)[entry_row].to(device)

    counts = counts.to(device=device, dtype=logits.dtype)
    values = flat.take(at)
    repetition = per_entry("repetition_penalty")
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = (values - per_entry("frequency_penalty") * counts
              - per_entry("presence_penalty") * (counts > 0))
    flat.index_copy_(0, at, values)


def _seen_tokens(histories: list[History],
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (row, token) pair where the token is in the row's prompt or output, with
    its count in the output: entry_row, token_ids, counts, each [seen]. A sequence's
    rows share their committed tokens (counted once per sequence, all sequences in one
    pass: a sort per sequence cost ~75 us, most of a penalised step at 2,000 rows); each
    row adds its own draft tokens."""
    base_of: dict[tuple[int, int, int], int] = {}
    bases: list[History] = []
    row_base = np.empty(len(histories), dtype=np.int64)  # [rows]
    for r, h in enumerate(histories):
        key = (id(h.token_ids), len(h.token_ids), h.prompt_len)
        if key not in base_of:
            base_of[key] = len(bases)
            bases.append(h)
        row_base[r] = base_of[key]
    seen, counts, first, num_seen = _committed_counts(bases, vocab)
    # each row's entries are its base's run of `seen` ([entries] below)
    num_entries = num_seen[row_base]  # [rows]
    run_start = np.repeat(first[row_base] - np.cumsum(num_entries) + num_entries, num_entries)
    at = run_start + np.arange(int(num_entries.sum()))  # [entries] index into seen
    keys = np.repeat(np.arange(len(histories)), num_entries) * vocab + (seen % vocab)[at]
    counts = counts[at]  # sorted by row, then token: unique
    drafted = [r * vocab + t for r, h in enumerate(histories) for t in h.drafted
               if 0 <= t < vocab]
    if drafted:  # a row's draft tokens: counted where seen already, new entries else
        extra, extra_count = np.unique(np.asarray(drafted, dtype=np.int64), return_counts=True)
        at = np.minimum(np.searchsorted(keys, extra), max(len(keys) - 1, 0))
        is_seen = keys[at] == extra if len(keys) else np.zeros(len(extra), dtype=bool)
        np.add.at(counts, at[is_seen], extra_count[is_seen])
        keys = np.concatenate([keys, extra[~is_seen]])
        counts = np.concatenate([counts, extra_count[~is_seen].astype(np.float32)])
    return (torch.from_numpy(keys // vocab), torch.from_numpy(keys % vocab),
            torch.from_numpy(counts))


def _committed_counts(bases: list[History], vocab: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ids each history has seen in its prompt or output, as keys base * vocab + id
    sorted (so each base's run is contiguous), their counts in the output, and each
    base's first index and length in them."""
    lengths = np.fromiter((len(h.token_ids) for h in bases), np.int64, len(bases))  # [bases]
    tokens = np.concatenate([np.asarray(h.token_ids, dtype=np.int64) for h in bases])
    base = np.repeat(np.arange(len(bases)), lengths)  # [tokens]
    offset = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    is_output = offset >= np.repeat([h.prompt_len for h in bases], lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    keys = base * vocab + tokens  # [tokens]
    # sorts of values, not np.unique's argsort: a third of the time at long contexts
    everything, output = np.sort(keys[valid]), np.sort(keys[valid & is_output])
    seen = everything[np.diff(everything, prepend=-1) != 0]  # keys are >= 0
    counts = (np.searchsorted(output, seen, "right")
              - np.searchsorted(output, seen, "left")).astype(np.float32)
    first = np.searchsorted(seen, np.arange(len(bases)) * vocab)
    num_seen = np.searchsorted(seen, np.arange(1, len(bases) + 1) * vocab) - first
    return seen, counts, first, num_seen


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min_p, then top-k, then top-p (nucleus) masking; logits: [num_rows, vocab] after
    temperature. Rows that do not ask for a truncation are left whole. Top-k and top-p
    each keep a row's tokens at or above a threshold logit read off the row's sorted
    values (no indices: on CPU numpy's vectorised sort of values takes a twentieth of
    torch's sort with indices, which was most of a sampled step), so tokens tied at a
    threshold are all kept."""
    vocab, device = logits.shape[-1], logits.device
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        is_below = probs < min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(is_below, -math.inf)
    sorted_logits = _sorted_descending(logits)  # [num_rows, vocab]
    threshold = sorted_logits[:, -1:]  # [num_rows, 1]: keeps everything
    if any(p.top_k for p in params):
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device).clamp(max=vocab)
        threshold = sorted_logits.gather(-1, (top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, -math.inf)
    if any(p.top_p < 1 for p in params):
        # a row with top_p = 1 keeps its tail even where the fp32 sum rounds up to 1
        top_p = torch.tensor([p.top_p if p.top_p < 1 else math.inf for p in params],
                             device=device, dtype=logits.dtype)
        weights = (sorted_logits - sorted_logits[:, :1]).exp_()  # unnormalised probs
        mass = weights.cumsum(-1)  # of the tokens up to each, [num_rows, vocab]
        # the tokens whose strictly better ones hold less than top_p; the likeliest always
        num_kept = 1 + torch.searchsorted(mass, top_p[:, None] * mass[:, -1:])  # [num_rows, 1]
        last = sorted_logits.gather(-1, num_kept.clamp(max=vocab) - 1)
        threshold = torch.maximum(threshold, last)
    return logits.masked_fill(logits < threshold, -math.inf)


def _sorted_descending(logits: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first: [num_rows, vocab]."""
    if logits.device.type != "cpu":
        return logits.sort(dim=-1, descending=True).values
    values = logits.detach().float().numpy()
    return torch.from_numpy(-np.sort(-values, axis=-1)).to(logits.dtype)


def token_logprobs(processed: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int]) -> list[TokenLogprob]:
    """Log-probabilities of the chosen tokens under the processed distributions.
    processed: [num_rows, vocab]; token_ids: [num_rows]; num_top[i]: alternatives row i
    reports (the likeliest first)."""
    logprobs = torch.log_softmax(processed.float(), dim=-1)  # [num_rows, vocab]
    chosen = logprobs.gather(-1, token_ids[:, None].long()).squeeze(-1).tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_lp, top_ids = top_lp.tolist(), top_ids.long().tolist()
    # alternatives a row cannot emit (-inf: truncated or outside its grammar) are left out
    return [TokenLogprob(int(t), lp, tuple((i, v) for i, v in zip(ids[:n], lps[:n])
                                           if v != -math.inf))
            for t, lp, ids, lps, n in zip(token_ids.tolist(), chosen, top_ids, top_lp, num_top)]


SAMPLE_ROWS = 32  # rows a float64 CDF is built for at once (a 152k vocabulary: 39 MB)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [num_rows, vocab] (need not be normalised);
    uniforms: [num_rows] in [0, 1). Returns token ids [num_rows]; never a zero-prob token.
    Rows in blocks, each row's arithmetic the same whatever the block."""
    if len(probs) > SAMPLE_ROWS:
        return torch.cat([sample_from_probs(probs[i:i + SAMPLE_ROWS],
                                            uniforms[i:i + SAMPLE_ROWS])
                          for i in range(0, len(probs), SAMPLE_ROWS)])
    cdf = probs.double().cumsum(-1)  # [num_rows, vocab]
    targets = (uniforms.double().to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(ids, last_nonzero)


# -- position-keyed randomness -----------------------------------------------------------------

STREAM_DRAFT, STREAM_ACCEPT, STREAM_SAMPLE = 1, 2, 3


def sibling_stream(stream: int, j: int) -> int:
    """A token tree's: the stream of the j-th child drawn (or tested) at a position; the
    first child's is the chain's own."""
    return stream + 16 * j
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (uint64 arithmetic wraps by definition)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def position_uniforms(seeds: list[int], positions: np.ndarray | list, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) for each (sequence seed, absolute position) and purpose.

    seeds: [batch]; positions: [batch, n] (or [batch]) -> float64 tensor of the same shape."""
    pos = np.asarray(positions, dtype=np.uint64)
    seed = np.asarray(seeds, dtype=np.uint64).reshape((-1,) + (1,) * (pos.ndim - 1))
    with np.errstate(over="ignore"):
        key = _mix64(seed * _GOLDEN + np.uint64(stream))
        bits = _mix64(key + pos * _GOLDEN)
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)
