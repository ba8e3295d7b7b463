#!/usr/bin/env python
"""Measure speculative-decoding quality/cost of the demo pair (CPU, batch 1, fp32).

Uses a minimal plain-torch Llama with a preallocated KV cache (checked against transformers' logits),
so per-forward costs reflect the models rather than framework overhead; HF timings are printed too.

  .venv/bin/python scripts/demo_pair/measure.py --models models --prompts 10 --new 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


class MiniLlama:
    def __init__(self, path: Path, max_len: int = 1024):
        cfg = json.loads((path / "config.json").read_text())
        w = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
        w = {k.removeprefix("model."): v for k, v in w.items()}
        self.L, self.H, self.KV = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.H
        self.eps = cfg["rms_norm_eps"]
        self.emb = w["embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.emb)
        self.norm = w["norm.weight"]
        self.layers = []
        for i in range(self.L):
            p = f"layers.{i}."
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                               w[p + "self_attn.v_proj.weight"]]),
                o=w[p + "self_attn.o_proj.weight"],
                gu=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                down=w[p + "mlp.down_proj.weight"]))
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        f = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        e = torch.cat([f, f], -1)
        self.cos, self.sin = e.cos(), e.sin()
        self.k = torch.zeros(self.L, self.KV, max_len, self.hd)
        self.v = torch.zeros(self.L, self.KV, max_len, self.hd)
        self.n = 0

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def _rot(x):
        a, b = x.chunk(2, -1)
        return torch.cat([-b, a], -1)

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        T, n = len(ids), self.n
        x = self.emb[torch.tensor(ids)]
        cos, sin = self.cos[n:n + T], self.sin[n:n + T]
        H, KV, hd = self.H, self.KV, self.hd
        mask = None
        if T > 1:
            mask = torch.ones(T, n + T, dtype=torch.bool).tril(diagonal=n)
        for i, l in enumerate(self.layers):
            h = self._rms(x, l["ln1"]) @ l["qkv"].T
            q = h[:, :H * hd].view(T, H, hd).transpose(0, 1)
            k = h[:, H * hd:(H + KV) * hd].view(T, KV, hd).transpose(0, 1)
            v = h[:, (H + KV) * hd:].view(T, KV, hd).transpose(0, 1)
            q = q * cos + self._rot(q) * sin
            k = k * cos + self._rot(k) * sin
            self.k[i, :, n:n + T] = k
            self.v[i, :, n:n + T] = v
            kk = self.k[i, :, :n + T].repeat_interleave(H // KV, 0)
            vv = self.v[i, :, :n + T].repeat_interleave(H // KV, 0)
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + a.transpose(0, 1).reshape(T, H * hd) @ l["o"].T
            g, u = (self._rms(x, l["ln2"]) @ l["gu"].T).chunk(2, -1)
            x = x + (F.silu(g) * u) @ l["down"].T
        self.n = n + T
        return self._rms(x, self.norm) @ self.head.T

    def truncate(self, n: int):
        self.n = min(self.n, n)


def warp(logits, temp, top_p):
    if temp == 0:
        return None
    p = torch.softmax(logits / temp, -1)
    sp, si = p.sort(descending=True)
    keep = sp.cumsum(-1) - sp < top_p
    sp = sp * keep
    out = torch.zeros_like(p).scatter_(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


def speculate(target, draft, prompt, new, gamma, temp=0.0, top_p=1.0, gen=None):
    """Standard speculative decoding (greedy if temp == 0, else rejection sampling). Returns stats."""
    target.n = draft.n = 0
    ctx = list(prompt)
    tl = target.forward(ctx)[-1]
    draft.forward(ctx[:-1])  # draft cache holds all but the last context token
    sample = lambda pr: int(torch.multinomial(pr, 1, generator=gen))
    first = int(tl.argmax()) if temp == 0 else sample(warp(tl, temp, top_p))
    ctx.append(first)
    tested, acc = [0] * gamma, [0] * gamma
    rounds = accepted = 0
    while len(ctx) - len(prompt) < new:
        base = len(ctx) - 1  # position of the newest (not yet target-cached) token
        pend = ctx[draft.n:]
        dtoks, qs = [], []
        for _ in range(gamma):
            dl = draft.forward(pend)[-1]
            if temp == 0:
                t = int(dl.argmax())
            else:
                q = warp(dl, temp, top_p); qs.append(q); t = sample(q)
            dtoks.append(t); pend = [t]
        tlog = target.forward([ctx[-1]] + dtoks)  # gamma+1 rows
        k = 0
        for i in range(gamma):
            tested[i] += 1
            if temp == 0:
                ok = int(tlog[i].argmax()) == dtoks[i]
            else:
                p = warp(tlog[i], temp, top_p)
                r = torch.rand((), generator=gen).item()
                ok = r < min(1.0, (p[dtoks[i]] / qs[i][dtoks[i]]).item())
            if not ok:
                break
            acc[i] += 1; k += 1
        if temp == 0:
            nxt = int(tlog[k].argmax())
        else:
            p = warp(tlog[k], temp, top_p)
            if k < gamma:
                res = (p - qs[k]).clamp_min(0)
                p = res / res.sum() if res.sum() > 0 else p
            nxt = sample(p)
        ctx.extend(dtoks[:k] + [nxt])
        rounds += 1; accepted += k
        target.truncate(base + 1 + k)
        draft.truncate(base + 1 + k)
    return dict(tested=tested, acc=acc, rounds=rounds, accepted=accepted, tokens=ctx[len(prompt):])


def heldout_prompts(tok, n, plen):
    root = Path(sysconfig.get_paths()["stdlib"])
    mods = [l.strip() for l in (REPO / "data" / "heldout_modules.txt").read_text().splitlines() if l.strip()]
    out = []
    for m in mods[:n]:
        ids = tok((root / m).read_text(), add_special_tokens=False)["input_ids"]
        out.append((m, ids[:plen]))
    return out


def summarize(name, runs, gamma):
    tested = [sum(r["tested"][i] for r in runs) for i in range(gamma)]
    acc = [sum(r["acc"][i] for r in runs) for i in range(gamma)]
    rounds = sum(r["rounds"] for r in runs); accepted = sum(r["accepted"] for r in runs)
    alpha = sum(acc) / sum(tested)
    per = [a / t if t else float("nan") for a, t in zip(acc, tested)]
    print(f"[{name}] rounds {rounds}  alpha(accepted/tested) {alpha:.3f}  accepted/(gamma*rounds) "
          f"{accepted / (gamma * rounds):.3f}  per-position " + " ".join(f"{x:.3f}" for x in per)
          + f"  mean tokens/round (accepted+1) {(accepted + rounds) / rounds:.2f}", flush=True)
    return dict(alpha=alpha, per_position=per, frac=accepted / (gamma * rounds),
                tokens_per_round=(accepted + rounds) / rounds, rounds=rounds)


def time_decode(step, reps=200):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=str(REPO / "models"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--plen", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append-md", action="store_true", help="append the results to <models>/TRAINING.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    md = Path(args.models)
    tok = AutoTokenizer.from_pretrained(md / "demo-target")
    T, D = MiniLlama(md / "demo-target"), MiniLlama(md / "demo-draft")
    hf_t = AutoModelForCausalLM.from_pretrained(md / "demo-target", dtype=torch.float32).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(md / "demo-draft", dtype=torch.float32).eval()
    prompts = heldout_prompts(tok, args.prompts, args.plen)

    # correctness of the mini implementation
    ids = prompts[0][1]
    with torch.no_grad():
        for mini, hf in ((T, hf_t), (D, hf_d)):
            mini.n = 0
            a = mini.forward(ids[:100]); b = mini.forward(ids[100:101])
            ref = hf(input_ids=torch.tensor([ids[:101]])).logits[0]
            err = max((a - ref[:100]).abs().max().item(), (b - ref[100:]).abs().max().item())
            print(f"mini-vs-HF max |logit diff| = {err:.2e}")

    res = {}
    runs = [speculate(T, D, p, args.new, args.gamma) for _, p in prompts]
    res["greedy"] = summarize("greedy gamma=%d" % args.gamma, runs, args.gamma)
    # sanity: speculative greedy output == plain target greedy
    T.n = 0; ctx = list(prompts[0][1]); l = T.forward(ctx)[-1]; plain = []
    for _ in range(args.new):
        t = int(l.argmax()); plain.append(t); l = T.forward([t])[-1]
    print("speculative greedy == target greedy:", runs[0]["tokens"][:args.new] == plain)
    gen = torch.Generator().manual_seed(args.seed)
    runs_s = [speculate(T, D, p, args.new, args.gamma, 0.7, 0.95, gen) for _, p in prompts]
    res["sampled"] = summarize("T=0.7 top-p=0.95 gamma=%d" % args.gamma, runs_s, args.gamma)

    # cost ratio c at batch 1, one decode token with KV cache (context = prompt length)
    for m in (T, D):
        m.n = 0; m.forward(prompts[0][1])
    base = T.n
    def st(m):
        m.n = base; m.forward([17])
    for _ in range(20):
        st(T); st(D)
    tt, td = time_decode(lambda: st(T)), time_decode(lambda: st(D))
    print(f"[cost mini] target {tt*1e3:.3f} ms/token  draft {td*1e3:.3f} ms/token  c = {td/tt:.3f}")
    res["c_mini"] = td / tt
    with torch.no_grad():
        x = torch.tensor([prompts[0][1]])
        def hf_step(m):
            o = m(input_ids=x, use_cache=True)
            pk = o.past_key_values
            one = torch.tensor([[17]])
            def f():
                m(input_ids=one, past_key_values=pk, use_cache=True)
                pk.crop(-1)
            return f
        ft, fd = hf_step(hf_t), hf_step(hf_d)
        for _ in range(10):
            ft(); fd()
        ht, hd = time_decode(ft, 100), time_decode(fd, 100)
    print(f"[cost HF]   target {ht*1e3:.3f} ms/token  draft {hd*1e3:.3f} ms/token  c = {hd/ht:.3f}")
    res["c_hf"] = hd / ht

    # sample text
    m, p = prompts[min(1, len(prompts) - 1)]
    with torch.no_grad():
        g = hf_t.generate(torch.tensor([p[-48:]]), max_new_tokens=120, do_sample=False)
    sample = tok.decode(p[-48:]) + "<<<|>>>" + tok.decode(g[0, 48:])
    print(f"--- sample (target greedy, prompt = last 48 prompt tokens of {m}) ---")
    print(sample)
    print("---")
    print(json.dumps(res))
    if args.append_md:
        gr, sa = res["greedy"], res["sampled"]
        pp = lambda r: ", ".join(f"{x:.3f}" for x in r["per_position"])
        md_ = [
            "", "## Measured speculative decoding (scripts/demo_pair/measure.py)", "",
            f"{len(prompts)} held-out modules, prompt = first {args.plen} tokens, {args.new} new tokens each, "
            f"gamma = {args.gamma}, batch 1, CPU fp32 ({args.threads} thread), weights as shipped (bf16 -> fp32). "
            "alpha = accepted drafts / drafts tested (a draft is tested only if all earlier ones in the round were "
            "accepted); tokens/round = accepted drafts + 1 target token.", "",
            "| decoding | alpha | alpha at draft position 1..4 | accepted/(gamma*rounds) | tokens/round |",
            "|---|---|---|---|---|",
            f"| greedy | {gr['alpha']:.3f} | {pp(gr)} | {gr['frac']:.3f} | {gr['tokens_per_round']:.2f} |",
            f"| T=0.7, top-p=0.95 (rejection sampling) | {sa['alpha']:.3f} | {pp(sa)} | {sa['frac']:.3f} | "
            f"{sa['tokens_per_round']:.2f} |", "",
            f"Cost ratio c = draft / target time for one decode token with KV cache (batch 1): "
            f"{res['c_mini']:.3f} (plain-torch loop: target {tt*1e3:.2f} ms, draft {td*1e3:.2f} ms); "
            f"{res['c_hf']:.3f} with transformers' forward (target {ht*1e3:.2f} ms, draft {hd*1e3:.2f} ms).", "",
            f"Sample (target greedy; prompt = 48 tokens of held-out `{m}`, generation after `<<<|>>>`):", "",
            "```python", sample, "```", ""]
        with open(md / "TRAINING.md", "a") as f:
            f.write("\n".join(md_))


if __name__ == "__main__":
    main()
