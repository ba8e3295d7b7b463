#!/usr/bin/env python
"""Distil a draft with a tokenizer of its own from the demo target (issue 65).

The draft's vocabulary is not the target's, so the target's distribution cannot be
matched token by token (the KL of scripts/train_demo_pair.py); it is matched on text
instead (sequence-level distillation): the draft learns next-token prediction, in its own
tokens, on the target's own continuations (greedy and sampled at T 0.7, top-p 0.9) and on
the corpus, half and half.

  1. the target's continuations of training prompts, decoded to text
  2. the draft's tokenizer: byte-level BPE of its own size, trained on every other corpus
     file (other data, other merges), lossless on every held-out module
  3. the draft (the demo draft's shape in its vocabulary), next-token CE, cosine lr
  4. with --fine-tune (from the draft in --out): for sampling, the KL of the target's
     next-token distribution against the draft's over the tokens both vocabularies share
     (what a sampled row drafts from, DESIGN §2.9), at T 1 and 0.7, where both
     tokenizations end a token at one byte, in turn with CE on the corpus

Writes an HF folder (safetensors, bfloat16, tokenizer) and its train_record.json.

The shipped models/demo-draft-bpe2k (models/TRAINING.md):
  .venv/bin/python scripts/train_cross_draft.py --out models/demo-draft-bpe2k --vocab 2048 \
      --gen-minutes 2.5 --draft-minutes 20
  .venv/bin/python scripts/train_cross_draft.py --out models/demo-draft-bpe2k --fine-tune \
      --gen-minutes 2 --draft-minutes 15 --lr 1e-3
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import (  # noqa: E402
    EOS,
    REPO,
    WindowSampler,
    bf16_roundtrip_,
    build,
    collect_corpus,
    draft_config,
    encode_stream,
    eval_loss,
    gen_greedy,
    lr_at,
    make_opt,
    read_heldout,
    save_model,
    train_tokenizer,
)


def continuations(target, stream, minutes: float, temperature: float, seed: int) -> torch.Tensor:
    """The target's continuations [n, 96 + 160] of prompts from `stream` (gen_greedy's)."""
    args = SimpleNamespace(seed=seed, gen_prompt=96, gen_new=160, gen_batch=32,
                           gen_minutes=minutes, gen_temperature=temperature, gen_top_p=0.9)
    return gen_greedy(target, stream, args, {})


def next_token_ce(draft, sampler: WindowSampler, batch: int) -> torch.Tensor:
    """Next-token CE on a batch of the sampler's windows."""
    tokens = sampler.batch(batch)
    logits = draft(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def train(draft, losses: dict[str, Callable[[], torch.Tensor]], args) -> dict:
    """A step on each loss in turn, cosine lr, until the time budget is spent."""
    opt = make_opt(draft, args.lr, wd=0.0)
    draft.train()
    names, ema = list(losses), {}
    t0, step = time.time(), 0
    while (frac := (time.time() - t0) / (args.draft_minutes * 60)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, args.lr, 0.03)
        name = names[step % len(names)]
        loss = losses[name]()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        ema[name] = loss.item() if name not in ema else 0.98 * ema[name] + 0.02 * loss.item()
        if step % 50 == 0:
            shown = ", ".join(f"{n} {v:.3f}" for n, v in ema.items())
            print(f"  draft step {step}: {shown}; {time.time() - t0:.0f} s", flush=True)
    return dict(steps=step, seconds=round(time.time() - t0), final_ema=ema)


def aligned_examples(generated: torch.Tensor, bridge, seq: int):
    """Each target continuation [n, L] as (its target ids, its draft ids [<= seq + 1], and
    the (draft position, target position) pairs where both tokenizations end a token at
    one byte: there the next token's distributions, restricted to the tokens both
    vocabularies share, are comparable."""
    from outrider.engine.cross_vocab import _encode

    out = []
    for ids in generated.tolist():
        ends, text = {}, bytearray()
        for j, t in enumerate(ids):
            text += bridge._target_bytes[t]
            ends[len(text)] = j
        own = _encode(bridge.draft, bridge._draft_byte_ids, bytes(text))[:seq + 1]
        pairs, offset = [], 0
        for i, d in enumerate(own[:-1]):
            offset += len(bridge._draft_bytes[d])
            if offset in ends and ends[offset] < len(ids) - 1:
                pairs.append((i, ends[offset]))
        out.append((ids, own, pairs))
    return out


def shared_kl(draft, target, examples, shared, temperatures) -> torch.Tensor:
    """KL(target || draft) of the next-token distributions at aligned positions, over the
    tokens both vocabularies share (what a sampled row drafts from, DESIGN §2.9), at each
    temperature, averaged."""
    own_ids = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(o) for _, o, _ in examples], batch_first=True)
    with torch.no_grad():
        t_logits = target(input_ids=torch.tensor([t for t, _, _ in examples])).logits
    d_logits = draft(input_ids=own_ids).logits
    rows = [(b, i, j) for b, (_, _, pairs) in enumerate(examples) for i, j in pairs]
    b, i, j = (torch.tensor(x) for x in zip(*rows))
    own_shared = (shared >= 0).nonzero().squeeze(-1)  # draft ids [S]
    t_rows = t_logits[b, j]  # [P, target vocab]
    d_rows = d_logits[b, i][:, own_shared]  # [P, S]
    loss = 0.0
    for tau in temperatures:
        p = torch.softmax(t_rows / tau, -1)[:, shared[own_shared]]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        loss = loss + (p * (p.clamp_min(1e-12).log()
                            - torch.log_softmax(d_rows / tau, -1))).sum(-1).mean()
    return loss / len(temperatures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models" / "demo-target"))
    ap.add_argument("--out", default=str(REPO / "models" / "demo-draft-bpe2k"))
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--heldout", default=str(REPO / "outrider" / "bench" / "data"
                                             / "heldout_modules.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--gen-minutes", type=float, default=2.0,
                    help="for each of the greedy and the sampled continuations")
    ap.add_argument("--draft-minutes", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--fine-tune", action="store_true",
                    help="start from the draft in --out and its tokenizer, and train the "
                         "tokens both vocabularies share against the target's distribution "
                         "(at T 1 and 0.7) beside CE on the corpus")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train_files, held_files = collect_corpus(read_heldout(Path(args.heldout)))
    target_tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    corpus_target = encode_stream(target_tok, [t for _, t in train_files])
    with torch.no_grad():
        generated = torch.cat([continuations(target, corpus_target, args.gen_minutes, t,
                                             args.seed + i) for i, t in enumerate((0.0, 0.7))])
    texts = target_tok.batch_decode(generated, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)

    if args.fine_tune:
        return fine_tune_main(args, target, target_tok, generated, train_files, held_files)
    tok = train_tokenizer([t for _, t in train_files[::2]], args.vocab, model_max_length=2048)
    for rel, text in held_files:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text, rel
    assert tok.get_vocab() != target_tok.get_vocab()
    corpus = encode_stream(tok, [t for _, t in train_files])
    target_text = encode_stream(tok, texts)
    held = encode_stream(tok, [t for _, t in held_files])
    print(f"[data] {len(corpus)} corpus tokens, {len(target_text)} of the target's "
          f"({len(texts)} continuations), vocab {len(tok)}", flush=True)

    draft = build(draft_config(len(tok), tok.convert_tokens_to_ids(EOS)))
    corpus_windows = WindowSampler(corpus, args.seq, args.seed)
    target_windows = WindowSampler(target_text, args.seq, args.seed + 1)
    record = train(draft, {"corpus": lambda: next_token_ce(draft, corpus_windows, args.batch),
                           "target's": lambda: next_token_ce(draft, target_windows,
                                                             args.batch)}, args)
    out = Path(args.out)
    save_model(draft, tok, out)
    bf16_roundtrip_(draft)
    held_bytes = sum(len(t.encode()) for _, t in held_files)
    record.update(
        command="python " + " ".join(shlex.quote(a) for a in
                                     ["scripts/train_cross_draft.py"] + sys.argv[1:]),
        vocab=len(tok), params=sum(p.numel() for p in draft.parameters()),
        continuations=len(texts), corpus_tokens=len(corpus), target_text_tokens=len(target_text),
        heldout_loss=eval_loss(draft, held, args.seq),
        heldout_bytes_per_token=held_bytes / len(held))
    (out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1), flush=True)


def fine_tune_main(args, target, target_tok, generated, train_files, held_files) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from outrider.engine.cross_vocab import pair_bridge

    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(out)
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    bridge = pair_bridge(args.target, str(out))
    examples = [e for e in aligned_examples(generated, bridge, args.seq) if e[2]]
    corpus = encode_stream(tok, [t for _, t in train_files])
    print(f"[fine-tune] {len(examples)} continuations, "
          f"{sum(len(e[2]) for e in examples)} aligned positions", flush=True)
    # CE on corpus windows (greedy drafting keeps its text), in turn with the shared-token
    # KL on the target's continuations
    corpus_windows = WindowSampler(corpus, args.seq, args.seed)
    picks = torch.Generator().manual_seed(args.seed)

    def kl() -> torch.Tensor:
        picked = torch.randint(len(examples), (args.batch,), generator=picks).tolist()
        return shared_kl(draft, target, [examples[k] for k in picked], bridge.shared, (1.0, 0.7))
    record = train(draft, {"ce": lambda: next_token_ce(draft, corpus_windows, args.batch),
                           "kl": kl}, args)
    save_model(draft, tok, out)
    bf16_roundtrip_(draft)
    held = encode_stream(tok, [t for _, t in held_files])
    path = out / "train_record.json"
    first = json.loads(path.read_text())
    first["fine_tune"] = dict(record, heldout_loss=eval_loss(draft, held, args.seq),
                              command="python " + " ".join(shlex.quote(a) for a in
                                                           ["scripts/train_cross_draft.py"]
                                                           + sys.argv[1:]))
    path.write_text(json.dumps(first, indent=1) + "\n")
    print(json.dumps(first["fine_tune"], indent=1), flush=True)


if __name__ == "__main__":
    main()
