#!/usr/bin/env python
"""Train Outrider's shipped demo model pair (target + speculative draft) on CPU.

Stages (all seeded, fixed data order; the two training stages stop by wall-clock budget):
  1. corpus     : Python standard-library sources (held-out modules listed in outrider/bench/data/heldout_modules.txt)
  2. tokenizer  : byte-level BPE, vocab 4096, trained with `tokenizers`
  3. target     : LlamaForCausalLM (~10M params, 8 layers, GQA), next-token CE
  4. greedy data: target's own greedy continuations of training prompts
  5. draft      : 1-layer LlamaForCausalLM (<1/10 target params) distilled from the target:
                  KL(target || draft) at T=1 + CE on the target's argmax token
                  (on corpus windows and on target-greedy sequences, 50/50)

Both models are saved in HF format (safetensors, bfloat16) under <out>/demo-target and
<out>/demo-draft with the tokenizer, and <out>/TRAINING.md summarises the run.

Example:
  .venv/bin/python scripts/train_demo_pair.py --out models --threads 2 \
      --target-minutes 45 --draft-minutes 25
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
SKIP_DIRS = (
    "test/",
    "tests/",
    "idlelib/",
    "tkinter/",
    "lib2to3/",
    "site-packages/",
    "pydoc_data/",
    "turtledemo/",
    "__phello__/",
    "ensurepip/",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_heldout(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def collect_corpus(heldout: list[str]):
    root = stdlib_root()
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(rel.startswith(d) or f"/{d}" in rel for d in SKIP_DIRS):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 300_000 or len(text) < 200:
            continue
        if rel.startswith("encodings/") and "decoding_table" in text:  # generated codec tables
            continue
        (held if rel in heldout else train).append((rel, text))
    missing = set(heldout) - {r for r, _ in held}
    if missing:
        raise SystemExit(f"held-out modules not found in stdlib: {sorted(missing)}")
    return train, held


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_stream(hf_tok, texts: list[str]) -> torch.Tensor:
    eos = hf_tok.convert_tokens_to_ids(EOS)
    enc = hf_tok.backend_tokenizer.encode_batch(texts)
    ids = []
    for e in enc:
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- models
def target_config(vocab: int, eos: int, **shape):
    """The demo target's Llama config; `shape` overrides its size (the draft's)."""
    from transformers import LlamaConfig

    sizes = dict(hidden_size=320, intermediate_size=864, num_hidden_layers=8, head_dim=64)
    sizes.update(shape)
    return LlamaConfig(
        vocab_size=vocab,
        num_attention_heads=5,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **sizes,
    )


def draft_config(vocab: int, eos: int):
    return target_config(vocab, eos, hidden_size=160, intermediate_size=448,
                         num_hidden_layers=1, head_dim=32)


def build(cfg):
    from transformers import LlamaForCausalLM

    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg)
    m.config._attn_implementation = "sdpa"
    return m


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())  # tied embedding counted once


def save_model(model, tok, path: Path):
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    eos = tok.convert_tokens_to_ids(EOS)
    m.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    m.config.dtype = torch.bfloat16
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp, save_jinja_files=False)
    tc = json.loads((tmp / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4.x and 5.x alike
    (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    for f in tmp.iterdir():  # near-atomic replace so an interruption keeps the previous checkpoint
        os.replace(f, path / f.name)
    tmp.rmdir()


def bf16_roundtrip_(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


# --------------------------------------------------------------------------- training helpers
class WindowSampler:
    """Non-overlapping windows of seq+1 tokens, reshuffled each epoch with a seeded generator."""

    def __init__(self, stream: torch.Tensor, seq: int, seed: int):
        self.stream, self.seq = stream, seq
        self.n = (len(stream) - 1) // seq
        self.g = torch.Generator().manual_seed(seed)
        self.epoch, self.order, self.pos = 0, torch.randperm(self.n, generator=self.g), 0

    def batch(self, bs: int) -> torch.Tensor:
        rows = []
        for _ in range(bs):
            if self.pos >= self.n:
                self.epoch += 1
                self.order, self.pos = torch.randperm(self.n, generator=self.g), 0
            i = int(self.order[self.pos]) * self.seq
            self.pos += 1
            rows.append(self.stream[i : i + self.seq + 1])
        return torch.stack(rows)


def lr_at(frac: float, peak: float, warm_frac: float, min_ratio: float = 0.1) -> float:
    if frac < warm_frac:
        return peak * max(frac / warm_frac, 0.02)
    f = min(1.0, (frac - warm_frac) / max(1e-9, 1 - warm_frac))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * f)))


def make_opt(model, lr, wd=0.1):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


@torch.no_grad()
def eval_loss(model, stream, seq, max_windows=None):
    model.eval()
    n = (len(stream) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot, cnt = 0.0, 0
    for i in range(0, n, 16):
        rows = torch.stack([stream[j * seq : j * seq + seq + 1] for j in range(i, min(n, i + 16))])
        logits = model(input_ids=rows[:, :-1]).logits
        tot += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction="sum"
        ).item()
        cnt += rows[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


@torch.no_grad()
def eval_agreement(target, draft, stream, seq, max_windows=64):
    """Teacher-forced top-1 agreement draft vs target on held-out text."""
    target.eval()
    draft.eval()
    n = min((len(stream) - 1) // seq, max_windows)
    agree = tot = 0
    for i in range(0, n, 16):
        rows = torch.stack([stream[j * seq : j * seq + seq] for j in range(i, min(n, i + 16))])
        a = target(input_ids=rows).logits.argmax(-1)
        b = draft(input_ids=rows).logits.argmax(-1)
        agree += (a == b).sum().item()
        tot += a.numel()
    draft.train()
    return agree / max(tot, 1)


def fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", default=str(REPO / "models"), help="output directory (default: models/)"
    )
    ap.add_argument("--heldout", default=str(REPO / "outrider" / "bench" / "data" / "heldout_modules.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--target-minutes", type=float, default=45.0)
    ap.add_argument(
        "--target-steps", type=int, default=0, help="fixed step count (overrides time budget)"
    )
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--gen-minutes", type=float, default=4.0, help="budget for target-greedy data")
    ap.add_argument("--gen-temperature", type=float, default=0.0,
                    help="the target's continuations sampled at this temperature (0: greedy)")
    ap.add_argument("--gen-top-p", type=float, default=1.0, help="... and top-p")
    ap.add_argument("--kl-temperatures", default="1",
                    help="comma list: the draft matches the target's distribution at each "
                         "temperature (KL(target||draft) of both divided by it), averaged")
    ap.add_argument("--gen-prompt", type=int, default=96)
    ap.add_argument("--gen-new", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--draft-minutes", type=float, default=25.0)
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--hard-weight", type=float, default=1.0, help="weight of CE on target argmax")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument(
        "--reuse-target", action="store_true", help="load <out>/demo-target instead of training"
    )
    ap.add_argument(
        "--reuse-draft", action="store_true", help="fine-tune <out>/demo-draft instead of a new one"
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tdir, ddir = out / "demo-target", out / "demo-draft"
    stats: dict = {
        "command": "python "
        + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    }
    t_all = time.time()

    # 1. corpus
    heldout = read_heldout(Path(args.heldout))
    train_files, held_files = collect_corpus(heldout)
    stats["corpus"] = dict(
        train_files=len(train_files),
        train_bytes=sum(len(t) for _, t in train_files),
        heldout_files=len(held_files),
        heldout_bytes=sum(len(t) for _, t in held_files),
        python=sys.version.split()[0],
    )
    print(
        f"[corpus] {len(train_files)} train files ({stats['corpus']['train_bytes'] / 1e6:.1f} MB), "
        f"{len(held_files)} held-out files",
        flush=True,
    )

    # 2. tokenizer
    t0 = time.time()
    if args.reuse_target:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tdir)
    else:
        tok = train_tokenizer([t for _, t in train_files], args.vocab, model_max_length=2048)
    eos = tok.convert_tokens_to_ids(EOS)
    for rel, text in held_files:  # lossless round trip on every held-out module
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert (
            tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
        ), rel
    train_stream = encode_stream(tok, [t for _, t in train_files])
    held_stream = encode_stream(tok, [t for _, t in held_files])
    stats["tokenizer"] = dict(
        seconds=time.time() - t0,
        vocab=len(tok),
        train_tokens=len(train_stream),
        heldout_tokens=len(held_stream),
        bytes_per_token=stats["corpus"]["train_bytes"] / len(train_stream),
    )
    print(
        f"[tokenizer] vocab {len(tok)}, {len(train_stream)} train tokens "
        f"({stats['tokenizer']['bytes_per_token']:.2f} B/tok), {len(held_stream)} held-out tokens, "
        f"round-trip OK, {fmt_s(stats['tokenizer']['seconds'])}",
        flush=True,
    )

    # 3. target
    torch.manual_seed(args.seed)
    if args.reuse_target:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(
            tdir, dtype=torch.float32, attn_implementation="sdpa"
        )
        prev = (
            json.loads((out / "train_stats.json").read_text())
            if (out / "train_stats.json").exists()
            else {}
        )
        stats["target"] = prev.get("target", {"note": "reused"})
    else:
        target = build(target_config(len(tok), eos))
        stats["target"] = train_target(target, tok, train_stream, held_stream, args, tdir)
    stats["target"]["params"] = n_params(target)
    target.eval()
    bf16_roundtrip_(target)  # distil against exactly the shipped (bf16) weights
    stats["target"]["heldout_loss_bf16"] = eval_loss(target, held_stream, args.seq)
    print(
        f"[target] params {stats['target']['params'] / 1e6:.2f}M, held-out loss (bf16 weights) "
        f"{stats['target']['heldout_loss_bf16']:.3f}",
        flush=True,
    )
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1))
    for p in target.parameters():
        p.requires_grad_(False)

    # 4. target-greedy continuations
    greedy = gen_greedy(target, train_stream, args, stats)

    # 5. draft
    torch.manual_seed(args.seed + 1)
    if args.reuse_draft:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    else:
        draft = build(draft_config(len(tok), eos))
    stats["draft"] = train_draft(draft, target, tok, train_stream, held_stream, greedy, args, ddir)
    stats["draft"]["params"] = n_params(draft)
    stats["total_seconds"] = time.time() - t_all
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1))
    write_summary(out, stats, args)


def train_target(model, tok, train_stream, held_stream, args, save_dir):
    sampler = WindowSampler(train_stream, args.seq, args.seed)
    opt = make_opt(model, args.target_lr)
    budget = args.target_minutes * 60
    model.train()
    t0 = last_ck = time.time()
    step, tokens, ema = 0, 0, None
    total = args.target_steps or None
    pbar = tqdm(
        total=total or int(budget),
        desc="target",
        unit="step" if total else "s",
        mininterval=5,
        file=sys.stdout,
    )
    while True:
        el = time.time() - t0
        frac = step / total if total else el / budget
        if frac >= 1.0:
            break
        lr = lr_at(frac, args.target_lr, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sampler.batch(args.target_batch)
        out = model(input_ids=batch[:, :-1])
        loss = F.cross_entropy(
            out.logits.reshape(-1, out.logits.size(-1)), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch[:, 1:].numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if total:
            pbar.update(1)
        else:
            pbar.n = min(int(time.time() - t0), int(budget))
            pbar.refresh() if step % 20 == 0 else None
        pbar.set_postfix(
            loss=f"{ema:.3f}",
            lr=f"{lr:.2e}",
            tok=f"{tokens / 1e6:.2f}M",
            ep=sampler.epoch,
            refresh=False,
        )
        if step % 50 == 0:
            print(
                f"  target step {step} loss {ema:.3f} lr {lr:.2e} tokens {tokens} "
                f"{tokens / (time.time() - t0):.0f} tok/s",
                flush=True,
            )
        if time.time() - last_ck > args.ckpt_minutes * 60:
            save_model(model, tok, save_dir)
            last_ck = time.time()
            print(
                f"  [ckpt] target step {step}, held-out loss (32 win) "
                f"{eval_loss(model, held_stream, args.seq, 32):.3f}",
                flush=True,
            )
    pbar.close()
    secs = time.time() - t0
    save_model(model, tok, save_dir)
    return dict(
        seconds=secs,
        steps=step,
        tokens=tokens,
        batch=args.target_batch,
        seq=args.seq,
        peak_lr=args.target_lr,
        epochs=tokens / len(train_stream),
        final_train_loss_ema=ema,
        tokens_per_s=tokens / secs,
    )


@torch.no_grad()
def next_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> the target's next tokens [B]: argmax at temperature 0, else
    sampled at the temperature from the top-p nucleus."""
    if temperature == 0:
        return logits.argmax(-1)
    probs, order = torch.softmax(logits / temperature, -1).sort(-1, descending=True)
    probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    return order.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)


def gen_greedy(target, train_stream, args, stats):
    """Continuations by the target of prompts drawn (seeded) from the training stream:
    greedy, or sampled at --gen-temperature / --gen-top-p."""
    g = torch.Generator().manual_seed(args.seed + 7)
    P, N, B = args.gen_prompt, args.gen_new, args.gen_batch
    t0 = time.time()
    seqs = []
    pbar = tqdm(desc="greedy-gen", unit="seq", file=sys.stdout, mininterval=5)
    while time.time() - t0 < args.gen_minutes * 60:
        starts = torch.randint(0, len(train_stream) - P - 1, (B,), generator=g)
        ids = torch.stack([train_stream[s : s + P] for s in starts.tolist()])
        out = target(input_ids=ids, use_cache=True)
        pick = lambda logits: next_tokens(logits, args.gen_temperature, args.gen_top_p, g)  # noqa: E731
        past, nxt = out.past_key_values, pick(out.logits[:, -1])
        gen = [nxt]
        for _ in range(N - 1):
            out = target(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, pick(out.logits[:, -1])
            gen.append(nxt)
        seqs.append(torch.cat([ids, torch.stack(gen, 1)], 1))
        pbar.update(B)
    pbar.close()
    greedy = torch.cat(seqs)
    stats["greedy_data"] = dict(
        seconds=time.time() - t0,
        sequences=len(greedy),
        prompt_tokens=P,
        new_tokens=N,
        generated_tokens=len(greedy) * N,
        temperature=args.gen_temperature,
        top_p=args.gen_top_p,
    )
    print(
        f"[greedy] {len(greedy)} sequences x ({P}+{N}) tokens in {fmt_s(time.time() - t0)}",
        flush=True,
    )
    return greedy


def tempered_kl(t_logits: torch.Tensor, d_logits: torch.Tensor, temperature: float):
    """KL(target || draft) of the two distributions at `temperature`, per token: where a
    sampled draft token is accepted with min(1, p/q), what counts is q matching p as
    both are sampled, at the request's temperature."""
    t_logp = F.log_softmax(t_logits / temperature, -1)
    d_logp = F.log_softmax(d_logits / temperature, -1)
    return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()


def train_draft(draft, target, tok, train_stream, held_stream, greedy, args, save_dir):
    kl_temperatures = [float(t) for t in args.kl_temperatures.split(",")]
    sampler = WindowSampler(train_stream, args.seq, args.seed + 2)
    gg = torch.Generator().manual_seed(args.seed + 3)
    gorder, gpos = torch.randperm(len(greedy), generator=gg), 0
    L = min(args.seq, greedy.size(1))
    opt = make_opt(draft, args.draft_lr, wd=0.0)
    budget = args.draft_minutes * 60
    draft.train()
    target.eval()
    t0 = last_ck = time.time()
    step, tokens, ema_kl, ema_acc = 0, 0, None, None
    total = args.draft_steps or None
    pbar = tqdm(
        total=total or int(budget),
        desc="draft",
        unit="step" if total else "s",
        mininterval=5,
        file=sys.stdout,
    )
    while True:
        el = time.time() - t0
        frac = step / total if total else el / budget
        if frac >= 1.0:
            break
        lr = lr_at(frac, args.draft_lr, 0.03)
        for g_ in opt.param_groups:
            g_["lr"] = lr
        if step % 2 == 0:
            x = sampler.batch(args.draft_batch)[:, :-1]
        else:
            if gpos + args.draft_batch > len(greedy):
                gorder, gpos = torch.randperm(len(greedy), generator=gg), 0
            x = greedy[gorder[gpos : gpos + args.draft_batch], :L]
            gpos += args.draft_batch
        with torch.no_grad():
            t_logits = target(input_ids=x).logits
            t_arg = t_logits.argmax(-1)
        d_logits = draft(input_ids=x).logits
        d_logp = F.log_softmax(d_logits, -1)
        kl = sum(tempered_kl(t_logits, d_logits, t) for t in kl_temperatures) / len(kl_temperatures)
        hard = F.nll_loss(d_logp.reshape(-1, d_logp.size(-1)), t_arg.reshape(-1))
        loss = kl + args.hard_weight * hard
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        acc = (d_logits.argmax(-1) == t_arg).float().mean().item()
        ema_kl = kl.item() if ema_kl is None else 0.98 * ema_kl + 0.02 * kl.item()
        ema_acc = acc if ema_acc is None else 0.98 * ema_acc + 0.02 * acc
        if total:
            pbar.update(1)
        else:
            pbar.n = min(int(time.time() - t0), int(budget))
            pbar.refresh() if step % 20 == 0 else None
        pbar.set_postfix(kl=f"{ema_kl:.3f}", top1=f"{ema_acc:.3f}", lr=f"{lr:.2e}", refresh=False)
        if step % 50 == 0:
            print(
                f"  draft step {step} kl {ema_kl:.3f} top1-agree {ema_acc:.3f} lr {lr:.2e} tokens {tokens}",
                flush=True,
            )
        if time.time() - last_ck > args.ckpt_minutes * 60:
            save_model(draft, tok, save_dir)
            last_ck = time.time()
            print(f"  [ckpt] draft step {step}", flush=True)
    pbar.close()
    secs = time.time() - t0
    save_model(draft, tok, save_dir)
    bf16_roundtrip_(draft)
    agree = eval_agreement(target, draft, held_stream, args.seq)
    print(
        f"[draft] held-out teacher-forced top-1 agreement (bf16 weights): {agree:.3f}", flush=True
    )
    return dict(
        seconds=secs,
        steps=step,
        tokens=tokens,
        batch=args.draft_batch,
        seq=args.seq,
        peak_lr=args.draft_lr,
        final_kl_ema=ema_kl,
        final_train_top1_ema=ema_acc,
        heldout_top1_agreement=agree,
        hard_weight=args.hard_weight,
        kl_temperatures=kl_temperatures,
        fine_tuned=args.reuse_draft,
    )


def write_summary(out: Path, s: dict, args):
    c, tk, t, gd, d = s["corpus"], s["tokenizer"], s["target"], s["greedy_data"], s["draft"]
    lines = [
        "# Outrider demo model pair: training record",
        "",
        f"Produced by `scripts/train_demo_pair.py` on a 2-core CPU machine (no GPU), "
        f"torch {torch.__version__}, {args.threads} threads, fp32 training, weights saved in bfloat16.",
        "",
        "Exact command:",
        "",
        "```",
        s["command"],
        "```",
        "",
        "## Data",
        f"- Corpus: Python {c['python']} standard library `*.py` ({c['train_files']} files, "
        f"{c['train_bytes'] / 1e6:.1f} MB) excluding test/, idlelib/, tkinter/, lib2to3/, site-packages/, "
        "pydoc_data/, generated codec tables and files > 300 kB.",
        f"- Held-out (never trained on): {c['heldout_files']} modules listed in `outrider/bench/data/heldout_modules.txt` "
        f"({tk['heldout_tokens']} tokens).",
        "",
        "## Stages (wall-clock on this machine)",
        "",
        "| stage | time | tokens | notes |",
        "|---|---|---|---|",
        f"| tokenizer (byte-level BPE) | {fmt_s(tk['seconds'])} | {tk['train_tokens']:,} corpus tokens | "
        f"vocab {tk['vocab']}, {tk['bytes_per_token']:.2f} bytes/token, lossless round-trip checked |",
        f"| target pre-training | {fmt_s(t.get('seconds', 0))} | {t.get('tokens', 0):,} "
        f"({t.get('epochs', 0):.2f} epochs) | {t.get('steps', 0)} steps x {t.get('batch')}x{t.get('seq')}, "
        f"AdamW, peak lr {t.get('peak_lr')}, cosine |",
        f"| target greedy data | {fmt_s(gd['seconds'])} | {gd['generated_tokens']:,} generated | "
        f"{gd['sequences']} seqs, {gd['prompt_tokens']}-token prompts + {gd['new_tokens']} greedy tokens |",
        f"| draft distillation | {fmt_s(d['seconds'])} | {d['tokens']:,} | {d['steps']} steps x {d['batch']}x{d['seq']}, "
        f"KL(target||draft) + {d['hard_weight']} x CE(target argmax), half corpus / half target-greedy |",
        f"| total | {fmt_s(s['total_seconds'])} | | |",
        "",
        "## Models",
        "",
        f"- `demo-target`: LlamaForCausalLM, {t['params']:,} parameters (tied embeddings), 8 layers, hidden 320, "
        f"5 heads / 1 KV head (head_dim 64), FFN 864. Held-out loss (bf16 weights): {t['heldout_loss_bf16']:.3f} "
        f"nats/token (ppl {math.exp(t['heldout_loss_bf16']):.2f}).",
        f"- `demo-draft`: LlamaForCausalLM, {d['params']:,} parameters ({d['params'] / t['params']:.3f} x target), "
        f"1 layer, hidden 160, 5 heads / 1 KV head (head_dim 32), FFN 448. Held-out teacher-forced top-1 agreement "
        f"with the target: {d['heldout_top1_agreement']:.3f}.",
        "- Both share the tokenizer (`<|endoftext|>` = bos = eos = pad, id 0), max_position_embeddings 2048, "
        "rope_theta 10000; trained on 256-token windows.",
        "",
    ]
    text = "\n".join(lines)
    (out / "TRAINING.md").write_text(text)
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
