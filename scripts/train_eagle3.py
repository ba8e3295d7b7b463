#!/usr/bin/env python
"""Train an EAGLE-3 draft head for the shipped demo target on CPU, the SpecForge way.

  1. data      : the target regenerates the training text: its greedy continuations of
                 prompts drawn from the demo pair's training corpus (the Python standard
                 library, held-out modules excluded), half of the windows; the other half
                 are corpus windows as they are
  2. draft vocab: the most frequent tokens of that text (d2t / t2d map them)
  3. features  : the target's residual stream entering layers 2, L/2 and L-3, fused by `fc`
  4. training  : training-time test over --ttt-steps steps (each step feeds the head its
                 own output as the next feature, as drafting does, with attention over the
                 true positions and the drafted ones on its diagonal); soft labels: the
                 target's next-token distribution over the draft vocabulary

The head is saved in the layout vLLM, SGLang and SpecForge load (`midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`: the target's is shared), bfloat16.

Example:
  .venv/bin/python scripts/train_eagle3.py --out models/demo-eagle3 --threads 2 \
      --gen-minutes 3 --train-minutes 20
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from train_demo_pair import collect_corpus, read_heldout  # noqa: E402

from outrider.engine.heads import head_config_json, save_head  # noqa: E402


def load_target(model_dir: Path):
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    target.config._attn_implementation = "sdpa"
    return target.eval().requires_grad_(False)


def token_stream(model_dir: Path, heldout_file: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train, _ = collect_corpus(read_heldout(heldout_file))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([text for _, text in train]):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def greedy_windows(target, stream: torch.Tensor, args) -> torch.Tensor:
    """[n, prompt + new] token windows: the target's greedy continuations."""
    g = torch.Generator().manual_seed(args.seed)
    out, t0 = [], time.time()
    while time.time() - t0 < args.gen_minutes * 60:
        starts = torch.randint(0, len(stream) - args.gen_prompt, (args.gen_batch,), generator=g)
        ids = torch.stack([stream[s:s + args.gen_prompt] for s in starts.tolist()])
        step = target(input_ids=ids, use_cache=True)
        past, nxt, gen = step.past_key_values, step.logits[:, -1].argmax(-1), []
        for _ in range(args.gen_new):
            gen.append(nxt)
            step = target(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = step.past_key_values, step.logits[:, -1].argmax(-1)
        out.append(torch.cat([ids, torch.stack(gen, 1)], 1))
    windows = torch.cat(out)
    print(f"[data] {len(windows)} greedy windows x {windows.shape[1]} tokens in "
          f"{time.time() - t0:.0f} s", flush=True)
    return windows


def draft_vocab(windows: torch.Tensor, stream: torch.Tensor, vocab: int, size: int):
    """(d2t [size], t2d [vocab], coverage): the `size` most frequent target ids, in id order."""
    counts = torch.bincount(torch.cat([windows.flatten(), stream]), minlength=vocab)
    ids = counts.topk(size).indices.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    coverage = counts[ids].sum().item() / counts.sum().item()
    return ids - torch.arange(size), t2d, coverage


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [B, heads, T, d]; pos: [T] -> rotated (rotate-half convention)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]  # [T, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Head(torch.nn.Module):
    """The EAGLE-3 head as trained (dense attention over windows); names as saved."""

    def __init__(self, cfg: dict, target_hidden: int, num_taps: int) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv, self.hd = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                        cfg["head_dim"])
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(num_taps * target_hidden, h)
        self.q_proj, self.k_proj = lin(2 * h, self.heads * self.hd), lin(2 * h, self.kv * self.hd)
        self.v_proj, self.o_proj = lin(2 * h, self.kv * self.hd), lin(self.heads * self.hd, h)
        self.gate_proj, self.up_proj, self.down_proj = lin(h, inter), lin(h, inter), lin(inter, h)
        self.input_layernorm = torch.nn.Parameter(torch.ones(h))
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.lm_head = None  # set by the caller: [draft vocab, h]

    def step(self, embeds, feature, pos, cache):
        """One TTT step over [B, T]: embeds and feature [B, T, h] -> prenorm out [B, T, h].
        cache: the earlier steps' (k, v); step 0's keys are causal, later ones diagonal."""
        B, T, _ = embeds.shape
        x = torch.cat([rms(embeds, self.input_layernorm, self.eps),
                       rms(feature, self.hidden_norm, self.eps)], -1)
        q = rope(self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2), pos, self.theta)
        k = rope(self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2), pos, self.theta)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        k, v = (t.repeat_interleave(self.heads // self.kv, 1) for t in (k, v))
        cache.append((k, v))
        k0, v0 = cache[0]
        scale = self.hd ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [((q * kj).sum(-1, keepdim=True) * scale) for kj, _ in cache[1:]]
        attn = torch.cat(scores, -1).softmax(-1)  # [B, heads, T, T + steps]
        out = attn[..., :T] @ v0
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + attn[..., T + j:T + j + 1] * vj
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        residual = feature + out
        h = rms(residual, self.post_attention_layernorm, self.eps)
        return residual + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def saved_names(self) -> dict[str, str]:
        """The layout's tensor name of each of our parameters."""
        names = {"fc.weight": "fc.weight", "norm": "norm.weight",
                 "lm_head.weight": "lm_head.weight"}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{name}.weight"] = f"midlayer.self_attn.{name}.weight"
        for name in ("gate_proj", "up_proj", "down_proj"):
            names[f"{name}.weight"] = f"midlayer.mlp.{name}.weight"
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            names[name] = f"midlayer.{name}.weight"
        return names

    def tensors(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters())
        return {saved: params[ours].detach().to(torch.bfloat16)
                for ours, saved in self.saved_names().items()} | {"d2t": d2t, "t2d": t2d}

    def load(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """Continue from a head this script saved: its weights, and its (d2t, t2d)."""
        from safetensors.torch import load_file

        saved = load_file(str(path / "model.safetensors"))
        params = dict(self.named_parameters())
        with torch.no_grad():
            for ours, name in self.saved_names().items():
                params[ours].copy_(saved[name].float())
        return saved["d2t"], saved["t2d"]


def ttt_loss(head, target, ids: torch.Tensor, taps: tuple[int, ...], t2d, steps: int):
    """Mean soft cross-entropy per step over a batch of windows [B, T], and top-1 agreement."""
    B, T = ids.shape
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in taps], -1)  # [B, T, taps * H]
        p = out.logits[..., t2d].float().softmax(-1)  # [B, T, draft vocab]: p(x_{t+1} | ..t)
        embeds_all = target.model.embed_tokens(ids)
    feature, cache, losses, agree = head.fc(feats), [], [], []
    pos = torch.arange(T)
    for k in range(steps):
        n = T - 2 - k  # positions t with a label: p at t + 1 + k
        if n <= 0:
            break
        embeds = torch.zeros_like(embeds_all)
        embeds[:, :T - 1 - k] = embeds_all[:, 1 + k:]  # token x_{t+1+k} at t
        hidden = head.step(embeds, feature, pos + k, cache)
        logits = head.lm_head(rms(hidden[:, :n], head.norm, head.eps))
        labels = p[:, 1 + k:1 + k + n]
        losses.append(-(labels * logits.log_softmax(-1)).sum(-1).mean())
        agree.append((logits.argmax(-1) == labels.argmax(-1)).float().mean().item())
        feature = hidden
    return torch.stack(losses).mean(), agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models" / "demo-target"))
    ap.add_argument("--out", default=str(REPO / "models" / "demo-eagle3"))
    ap.add_argument("--heldout", default=str(REPO / "outrider" / "bench" / "data"
                                             / "heldout_modules.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--gen-minutes", type=float, default=3.0)
    ap.add_argument("--gen-prompt", type=int, default=64)
    ap.add_argument("--gen-new", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--train-minutes", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--init", help="continue training the head saved in this dir (its "
                                   "draft vocabulary kept)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    target_dir, out = Path(args.target), Path(args.out)
    target_raw = json.loads((target_dir / "config.json").read_text())
    target = load_target(target_dir)
    stream = token_stream(target_dir, Path(args.heldout))
    windows = greedy_windows(target, stream, args)
    d2t, t2d, coverage = draft_vocab(windows, stream, target_raw["vocab_size"],
                                     args.draft_vocab)
    print(f"[vocab] {args.draft_vocab} draft ids cover {coverage:.4f} of the data", flush=True)
    L = target_raw["num_hidden_layers"]
    taps = (2, L // 2, L - 3)
    cfg = head_config_json("eagle3", target_raw, draft_vocab_size=args.draft_vocab,
                           aux_layers=taps)
    head = Head(cfg, target_raw["hidden_size"], len(taps))
    head.lm_head = torch.nn.Linear(cfg["hidden_size"], args.draft_vocab, bias=False)
    if args.init:
        d2t, t2d = head.load(Path(args.init))
    else:
        with torch.no_grad():  # start from the target's own output rows
            head.lm_head.weight.copy_(target.lm_head.weight[t2d])
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    seq = windows.shape[1]
    g = torch.Generator().manual_seed(args.seed + 1)
    t0, step, log = time.time(), 0, []
    budget = args.train_minutes * 60
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for group in opt.param_groups:  # warm-up, then cosine to a tenth
            group["lr"] = args.lr * min(1.0, 20 * frac) * (0.55 + 0.45 * torch.cos(
                torch.tensor(frac * torch.pi)).item())
        half = args.batch // 2
        rows = windows[torch.randint(0, len(windows), (half,), generator=g)]
        starts = torch.randint(0, len(stream) - seq, (args.batch - half,), generator=g)
        ids = torch.cat([rows, torch.stack([stream[s:s + seq] for s in starts.tolist()])])
        loss, agree = ttt_loss(head, target, ids, taps, t2d, args.ttt_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            log.append({"step": step, "s": round(time.time() - t0), "loss": round(loss.item(), 4),
                        "top1_by_step": [round(a, 3) for a in agree]})
            print(f"[train] {log[-1]}", flush=True)
    save_head(out, cfg, head.tensors(d2t, t2d))
    record = {"command": shlex.join([Path(sys.executable).name, *sys.argv]),
              "steps": step, "seconds": round(time.time() - t0), "windows": len(windows),
              "draft_vocab_coverage": round(coverage, 4), "log": log[-8:],
              "torch": torch.__version__, "threads": args.threads}
    (out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"[done] {step} steps; saved {out}", flush=True)


if __name__ == "__main__":
    main()
