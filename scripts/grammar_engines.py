"""Compare two constrained-decoding (grammar) engines on CPU: llguidance and xgrammar.

For every --tokenizer (a HF tokenizer.json; tokenizer info is built from that file only):
  * tokenizer-info build time;
  * compile time, i.e. grammar source -> matcher -> first next-token mask, for a 6-property JSON
    schema, a date regex, a choice of 4 strings, a Lark arithmetic grammar and free JSON
    ({"type": "object"}): "first" (first compile in this process), "uncached" (median of repeats;
    xgrammar's cache cleared) and "cached" (xgrammar: cache hit; llguidance has no cache, so the
    server-side equivalent is used: deep_copy() of an already-built matcher);
  * mask time per token (us, median/p99): valid JSON documents are tokenized and walked token by
    token, computing the bitmask and then consuming the true token (fresh matcher per document);
  * rollback: consume 8 tokens, then rollback(8), at every position of the schema documents;
  * speculative-decoding masks for 4 draft tokens (5 masks) through one call (llguidance
    fill_next_token_bitmask_par_with_draft_tokens, xgrammar traverse_draft_tree on a chain),
    against 5 sequential mask + 4 consume + rollback(4);
  * whether JSON whitespace can be forbidden or bounded (accept/reject of sample strings);
  * install footprint (each distribution and what it pulls in) and import time/RSS.
Engines run single-threaded (--threads) so the figures compare per-core cost.

Setup (CPU only; install torch first so pip keeps the CPU build):
    python3 -m venv /tmp/gram-venv
    /tmp/gram-venv/bin/pip install torch==2.13.0
    /tmp/gram-venv/bin/pip install llguidance==1.9.1 xgrammar==0.2.8   # or the two wheel files
Run:
    /tmp/gram-venv/bin/python scripts/grammar_engines.py \
        --tokenizer models/demo-target/tokenizer.json [--tokenizer PATH2] --json OUT.json
"""
import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from importlib import metadata

import llguidance as llg
import llguidance.numpy as lln
import numpy as np
import tokenizers
import torch
import transformers
import xgrammar as xgr

EOS_NAMES = ["<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>"]
ROLES = ["admin", "editor", "viewer"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
        "active": {"type": "boolean"}, "role": {"enum": ROLES},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "score", "active", "role", "tags"],
    "additionalProperties": False,
}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
CHOICES = ["apple pie", "banana split", "cherry tart", "date loaf"]
GRAMMARS = {  # name -> (kind, source)
    "json_schema": ("json", SCHEMA),
    "regex_date": ("regex", r"\d{4}-\d{2}-\d{2}"),
    "choice4": ("regex", "(" + "|".join(CHOICES) + ")"),
    "lark_arith": ("lark", LARK),
    "free_json": ("json", {"type": "object"}),
}
WORDS = ["alpha", "beta", "gamma", "delta", "error", "timeout", "user", "order", "invoice", "Paris",
         "Zürich", "data", "model", "request", "value", "note", "42", "café", "résumé", "naïve"]


def now():
    return time.perf_counter_ns()


def us(t0, t1):
    return (t1 - t0) / 1e3


def stats(xs):
    a = np.asarray(xs, dtype=float)
    return {"median": round(float(np.median(a)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "n": len(a)}


# ---------------------------------------------------------------- documents
def schema_doc(rng):
    return {"name": " ".join(rng.sample(WORDS, rng.randint(1, 3))), "age": rng.randint(0, 99999),
            "score": round(rng.uniform(-1000, 1000), rng.randint(0, 4)),
            "active": rng.random() < 0.5, "role": rng.choice(ROLES),
            "tags": rng.sample(WORDS, rng.randint(0, 4))}


def free_value(rng, depth):
    r = rng.random()
    if depth < 3 and r < 0.2:
        n = rng.randint(1, 4)
        return {rng.choice(WORDS) + str(i): free_value(rng, depth + 1) for i in range(n)}
    if depth < 3 and r < 0.35:
        return [free_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return rng.choice([lambda: " ".join(rng.sample(WORDS, 2)), lambda: rng.randint(-10**6, 10**6),
                       lambda: round(rng.uniform(-1e3, 1e3), 3), lambda: rng.random() < 0.5,
                       lambda: None])()


def free_doc(rng):
    return {rng.choice(WORDS) + str(i): free_value(rng, 1) for i in range(8)}


def dumps(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- engines
class Tok:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.path, self.text = path, f.read()
        spec = json.loads(self.text)
        added = spec.get("added_tokens", [])
        self.n_vocab = max(list(spec["model"]["vocab"].values()) + [t["id"] for t in added]) + 1
        specials = {t["content"]: t["id"] for t in added if t.get("special")}
        self.eos_name = next((n for n in EOS_NAMES if n in specials), None) or next(iter(specials))
        self.eos = specials[self.eos_name]
        self.hf = tokenizers.Tokenizer.from_file(path)

    def encode(self, text):
        return self.hf.encode(text, add_special_tokens=False).ids


class LLG:
    name = "llguidance"

    def __init__(self, tok, threads):
        self.tok = llg.LLTokenizer(tok.text, n_vocab=tok.n_vocab, eos_token=tok.eos)
        self.ex = llg.LLExecutor(num_threads=threads)
        self.buf = lln.allocate_token_bitmask(8, tok.n_vocab)
        self.bits = self.buf

    def compile(self, kind, src, opts=None):
        M = llg.LLMatcher
        g = {"json": lambda: M.grammar_from_json_schema(src, defaults=opts),
             "regex": lambda: M.grammar_from_regex(src),
             "lark": lambda: M.grammar_from_lark(src)}[kind]()
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fresh(self, compiled):
        return compiled.deep_copy()

    def mask(self, m, row=0):
        lln.fill_next_token_bitmask(m, self.buf, row)

    def consume(self, m, t):
        return m.consume_token(t)

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_accepting() and not m.is_error()

    def draft(self, m, prev, drafts):
        lln.fill_next_token_bitmask_par_with_draft_tokens(self.ex, [(m, 0, drafts)], self.buf)

    def clear_cache(self):
        pass


class XGR:
    name = "xgrammar"

    def __init__(self, tok, threads):
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=tok.path, eos_token=tok.eos_name)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.n_vocab,
                                                  stop_token_ids=[tok.eos])
        self.comp = xgr.GrammarCompiler(info, max_threads=threads)
        self.buf = xgr.allocate_token_bitmask(8, tok.n_vocab)
        self.bits = self.buf.numpy()  # same memory
        self.chain = (torch.tensor([1, 2, 3, 4, -1]), torch.full((5,), -1, dtype=torch.int64))

    def compile(self, kind, src, opts=None):
        c = self.comp
        return {"json": lambda: c.compile_json_schema(json.dumps(src), **(opts or {})),
                "regex": lambda: c.compile_regex(src), "lark": lambda: c.compile_lark(src)}[kind]()

    def fresh(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def mask(self, m, row=0):
        m.fill_next_token_bitmask(self.buf, row)

    def consume(self, m, t):
        return m.accept_token(t)

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_completed()

    def draft(self, m, prev, drafts):  # node 0 = last accepted token, nodes 1..4 = drafts
        m.traverse_draft_tree(*self.chain, torch.tensor([prev] + drafts), self.buf[:5])

    def clear_cache(self):
        self.comp.clear_cache()


def allowed(eng, t, row=0):
    return (int(eng.bits[row, t >> 5]) >> (t & 31)) & 1


def ready(eng, kind, src, cached=None):
    """Grammar source (or cached artifact) -> first mask. Returns (compiled, us)."""
    t0 = now()
    compiled = cached if cached is not None else eng.compile(kind, src)
    m = eng.fresh(compiled) if (cached is not None or eng.name == "xgrammar") else compiled
    eng.mask(m)
    return compiled, us(t0, now())


# ---------------------------------------------------------------- measurements
def measure_compile(eng, reps):
    out = {}
    for name, (kind, src) in GRAMMARS.items():
        compiled, first = ready(eng, kind, src)
        unc = []
        for _ in range(reps):
            eng.clear_cache()
            unc.append(ready(eng, kind, src)[1])
        compiled = ready(eng, kind, src)[0]
        keep = None if eng.name == "xgrammar" else compiled  # xgrammar: its own cache
        hit = [ready(eng, kind, src, cached=keep)[1] for _ in range(reps)]
        out[name] = {"first_ms": round(first / 1e3, 3),
                     "uncached_ms": stats([x / 1e3 for x in unc]), "cached_us": stats(hit)}
    return out


def walk_masks(eng, compiled, docs, eos):
    mask_t, cons_t, bad = [], [], 0
    for ids in docs:
        m = eng.fresh(compiled)
        for t in ids:
            t0 = now()
            eng.mask(m)
            t1 = now()
            bad += not allowed(eng, t)
            ok = eng.consume(m, t)
            t2 = now()
            assert ok, f"{eng.name} rejected a valid token"
            mask_t.append(us(t0, t1))
            cons_t.append(us(t1, t2))
        eng.mask(m)
        bad += not (eng.accepting(m) and allowed(eng, eos))
    return {"mask_us": stats(mask_t), "consume_us": stats(cons_t), "rejected_true_tokens": bad}


def walk_rollback(eng, compiled, docs, k=8):
    cons, rb = [], []
    for ids in docs:
        m = eng.fresh(compiled)
        for i in range(len(ids) - k):
            t0 = now()
            ok = all(eng.consume(m, t) for t in ids[i:i + k])
            t1 = now()
            eng.rollback(m, k)
            t2 = now()
            assert ok
            cons.append(us(t0, t1))
            rb.append(us(t1, t2))
            eng.consume(m, ids[i])
    return {"consume8_us": stats(cons), "rollback8_us": stats(rb)}


def draft_api(eng, m, prev, drafts):
    """Masks for the current position and after each draft token, in one call."""
    eng.bits[:len(drafts) + 1] = 0
    t0 = now()
    eng.draft(m, prev, drafts)
    return us(t0, now()), eng.bits[:len(drafts) + 1].copy()


def draft_sequential(eng, m, prev, drafts):
    """The same masks the plain way: (mask, consume) per draft token, last mask, rollback."""
    t0 = now()
    for j, t in enumerate(drafts):
        eng.mask(m, j)
        eng.consume(m, t)
    eng.mask(m, len(drafts))
    eng.rollback(m, len(drafts))
    return us(t0, now()), eng.bits[:len(drafts) + 1].copy()


def walk_draft(eng, compiled, docs, k=4):
    times, same, n = {draft_api: [], draft_sequential: []}, 0, 0
    for ids in docs:
        m = eng.fresh(compiled)
        eng.consume(m, ids[0])
        for i in range(1, len(ids) - k):
            order = (draft_api, draft_sequential) if i % 2 else (draft_sequential, draft_api)
            masks = []
            for fn in order:
                t, mask = fn(eng, m, ids[i - 1], ids[i:i + k])
                times[fn].append(t)
                masks.append(mask)
            same += bool((masks[0] == masks[1]).all())
            n += 1
            eng.consume(m, ids[i])
    return {"draft_api_us": stats(times[draft_api]),
            "sequential_us": stats(times[draft_sequential]), "masks_identical": f"{same}/{n}"}


WS_SAMPLE = {"name": "Al", "age": 1, "score": 1.5, "active": True, "role": "admin", "tags": ["x"]}
WS_TEXTS = {"compact": dumps(WS_SAMPLE), "spaced": json.dumps(WS_SAMPLE),
            "indented": json.dumps(WS_SAMPLE, indent=2),
            "20_spaces": "{" + " " * 20 + dumps(WS_SAMPLE)[1:]}
WS_CONFIGS = {
    "llguidance": {
        "default": None,
        "whitespace_flexible=False": {"whitespace_flexible": False},
        "whitespace_pattern='[ ]?'": {"whitespace_pattern": "[ ]?"},
    },
    "xgrammar": {
        "default (any_whitespace=True)": None,
        "any_whitespace=False": {"any_whitespace": False},
        "any_whitespace=False,separators=(',',':')": {"any_whitespace": False,
                                                       "separators": (",", ":")},
        "max_whitespace_cnt=1": {"max_whitespace_cnt": 1},
    },
}


def whitespace(eng, tok):
    out = {}
    for label, opts in WS_CONFIGS[eng.name].items():
        try:
            compiled = eng.compile("json", SCHEMA, opts)
        except Exception as e:  # noqa: BLE001 - report, don't crash
            out[label] = f"error: {e}"
            continue
        row = {}
        for tname, text in WS_TEXTS.items():
            m = eng.fresh(compiled)
            row[tname] = all(eng.consume(m, t) for t in tok.encode(text)) and eng.accepting(m)
        out[label] = row
    return out


def footprint(dist):
    """Installed size of a distribution and of every distribution it pulls in (recursively)."""
    seen, stack = {}, [dist]
    while stack:
        name = re.sub(r"[-_.]+", "-", stack.pop()).lower()
        if name in seen:
            continue
        try:
            d = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        size = sum(f.locate().stat().st_size for f in d.files or [] if os.path.isfile(f.locate()))
        seen[name] = {"version": d.version, "mb": round(size / 2**20, 1)}
        reqs = [r for r in d.requires or [] if "extra ==" not in r]
        stack += [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in reqs]
    return {"self_mb": seen[re.sub(r"[-_.]+", "-", dist).lower()]["mb"],
            "total_mb": round(sum(v["mb"] for v in seen.values()), 1), "packages": seen}


def import_cost(module):
    code = (f"import re,time;t=time.perf_counter();import {module};t=time.perf_counter()-t;"
            "print(t, re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    s, rss = proc.stdout.split()
    return {"import_s": round(float(s), 3), "rss_mb": round(int(rss) / 1024, 1)}


# ---------------------------------------------------------------- main
def bench_tokenizer(path, args):
    tok = Tok(path)
    rng = random.Random(0)
    schema_docs = [tok.encode(dumps(schema_doc(rng))) for _ in range(args.docs)]
    free_docs = [tok.encode(dumps(free_doc(rng))) for _ in range(max(1, args.docs // 2))]
    res = {"path": path, "sha256": hashlib.sha256(tok.text.encode()).hexdigest(),
           "n_vocab": tok.n_vocab, "eos": tok.eos_name,
           "schema_tokens": sum(map(len, schema_docs)),
           "free_json_tokens": sum(map(len, free_docs)), "engines": {}}
    for cls in (LLG, XGR):
        t0 = now()
        eng = cls(tok, args.threads)
        t_info = us(t0, now()) / 1e3
        print(f"  {eng.name}: tokenizer info {t_info:.1f} ms", flush=True)
        r = {"tokenizer_info_ms": round(t_info, 1), "compile": measure_compile(eng, args.reps)}
        schema_c = eng.compile("json", SCHEMA)
        free_c = eng.compile("json", {"type": "object"})
        r["mask_json_schema"] = walk_masks(eng, schema_c, schema_docs, tok.eos)
        r["mask_free_json"] = walk_masks(eng, free_c, free_docs, tok.eos)
        r["rollback"] = walk_rollback(eng, schema_c, schema_docs)
        r["draft4"] = walk_draft(eng, schema_c, schema_docs)
        r["whitespace"] = whitespace(eng, tok)
        res["engines"][eng.name] = r
        del eng
    return res


def fmt(d):
    return f"{d['median']:.1f} / {d['p99']:.1f}"


def print_table(res):
    engines = list(res["engines"])
    print(f"\n== {res['path']}  (vocab {res['n_vocab']}, eos {res['eos']}; "
          f"{res['schema_tokens']} schema tokens, {res['free_json_tokens']} free-JSON tokens)")
    print(f"{'':40}" + "".join(f"{e:>30}" for e in engines))

    def row(label, fn):
        print(f"{label:40}" + "".join(f"{fn(res['engines'][e]):>30}" for e in engines))

    row("tokenizer info ms", lambda r: f"{r['tokenizer_info_ms']:.1f}")
    for g in GRAMMARS:
        row(f"{g}: first ms/uncached ms/cached us", lambda r, g=g: "{:.2f} / {:.2f} / {:.1f}"
            .format(r["compile"][g]["first_ms"], r["compile"][g]["uncached_ms"]["median"],
                    r["compile"][g]["cached_us"]["median"]))
    for k in ("mask_json_schema", "mask_free_json"):
        row(f"{k} us med/p99", lambda r, k=k: fmt(r[k]["mask_us"]))
        row("  consume us med/p99", lambda r, k=k: fmt(r[k]["consume_us"]))
        row("  true token rejected (must be 0)", lambda r, k=k: str(r[k]["rejected_true_tokens"]))
    row("consume 8 tokens us med/p99", lambda r: fmt(r["rollback"]["consume8_us"]))
    row("rollback(8) us med/p99", lambda r: fmt(r["rollback"]["rollback8_us"]))
    row("draft API, 4 drafts us med/p99", lambda r: fmt(r["draft4"]["draft_api_us"]))
    row("5 mask+4 consume+rollback us med/p99", lambda r: fmt(r["draft4"]["sequential_us"]))
    row("draft masks == sequential", lambda r: r["draft4"]["masks_identical"])
    for e in engines:
        for label, accepted in res["engines"][e]["whitespace"].items():
            print(f"  whitespace {e} {label}: {accepted}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", action="append", required=True,
                    help="tokenizer.json (repeatable)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. provenance)")
    ap.add_argument("--docs", type=int, default=60,
                    help="JSON-schema documents walked per vocabulary (half as many free-JSON)")
    ap.add_argument("--reps", type=int, default=20, help="repeats per compile measurement")
    ap.add_argument("--threads", type=int, default=1, help="engine threads (compile / executor)")
    args = ap.parse_args()
    dists = ("llguidance", "xgrammar")
    out = {"note": args.note, "python": sys.version.split()[0], "loadavg_start": os.getloadavg(),
           "threads": args.threads,
           "versions": {d: metadata.version(d) for d in (*dists, "torch")},
           "footprint": {d: footprint(d) for d in dists},
           "import": {d: import_cost(d) for d in dists}, "tokenizers": []}
    for path in args.tokenizer:
        print(f"tokenizer {path}", flush=True)
        out["tokenizers"].append(bench_tokenizer(path, args))
    out["loadavg_end"] = os.getloadavg()
    for res in out["tokenizers"]:
        print_table(res)
    for d, f in out["footprint"].items():
        pulled = sorted(((v["mb"], k) for k, v in f["packages"].items() if k != d), reverse=True)
        imp = out["import"][d]
        print(f"\nfootprint {d}: self {f['self_mb']} MB, with deps {f['total_mb']} MB; "
              f"import {imp['import_s']} s, RSS {imp['rss_mb']} MB; pulls: "
              + (", ".join(f"{k} {mb}" for mb, k in pulled) or "nothing"))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
