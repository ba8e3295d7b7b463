"""Target-only greedy decoding speed, Outrider vs transformers `generate`, side by side.

    python -m outrider.bench.engine_vs_hf [--threads 2] [--new-tokens 128] [--out FILE]

Builds a ~25M-parameter random Llama checkpoint, then alternates Outrider and
transformers runs (same process, same thread count, same prompts) at batch 1 and 8,
and reports tokens/s and their ratio (median of the repeats). Needs the `test` extra.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from outrider.bench.common import provenance
from outrider.core.sampling import SamplingParams
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder

PROMPT_LEN = 32


def build_checkpoint(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def time_outrider(decoder: SpeculativeDecoder, prompts, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = decoder.generate(prompts, params, gamma=0)
    elapsed = time.perf_counter() - start
    assert all(s.num_output == new_tokens for s in seqs)
    return len(prompts) * new_tokens / elapsed


@torch.inference_mode()
def time_hf(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == PROMPT_LEN + new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/engine_vs_hf.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_checkpoint(Path(tmp))
        runner = ModelRunner(RunnerConfig(tmp))
        decoder = SpeculativeDecoder(runner)
        params_m = sum(p.numel() for p in hf_model.parameters()) / 1e6
        g = torch.Generator().manual_seed(1)
        report = {"provenance": provenance(),
                  "machine": f"{platform.processor() or platform.machine()}, "
                             f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                  "params_millions": round(params_m, 1), "new_tokens": args.new_tokens,
                  "command": "python -m outrider.bench.engine_vs_hf "
                             f"--threads {args.threads} --new-tokens {args.new_tokens}",
                  "batches": {}}
        for batch in (1, 8):
            prompts = torch.randint(3, 8192, (batch, PROMPT_LEN), generator=g).tolist()
            time_outrider(decoder, prompts, 8)  # warm-up both
            time_hf(hf_model, prompts, 8)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(time_outrider(decoder, prompts, args.new_tokens))
                theirs.append(time_hf(hf_model, prompts, args.new_tokens))
            row = {"outrider_tok_s": statistics.median(ours),
                   "transformers_tok_s": statistics.median(theirs)}
            row["ratio"] = row["outrider_tok_s"] / row["transformers_tok_s"]
            report["batches"][str(batch)] = row
            print(f"batch {batch}: outrider {row['outrider_tok_s']:.1f} tok/s, transformers "
                  f"{row['transformers_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
