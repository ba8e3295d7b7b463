"""A draft head's replica killed and restarted under one long generation: does the head
draft again once it is back?

    python scripts/head_replica_restart.py [--max-tokens 1500] [--kill-after-s 0.6]

Starts `outrider draft-worker` with the demo EAGLE-3 head (the target's embedding beside
it) and `outrider target-worker` with it (--draft-head, --draft-address), streams one
greedy generation with FIXED γ 4 and the head alone proposing (no lookups), kills the
draft replica --kill-after-s into the stream and starts it again on the same port. The
table is the stream's rounds in eight equal parts: draft tokens and accepted ones. While
the replica is down the rounds draft nothing; once it is back the head, which lost the
sequence, is sent the whole context with the features the target kept beside its KV
(docs/DESIGN.md §8.8), and drafts again.
"""

from __future__ import annotations

import argparse
import threading
import time

import grpc

from outrider import paths
from outrider.core.sampling import SamplingParams, sampling_to_proto
from outrider.core.tokenizer import Tokenizer
from outrider.grpc_server import token_metadata
from outrider.launch import free_port, start_process, stop_process
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

TOKEN = "head-restart-check"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--kill-after-s", type=float, default=0.6)
    args = parser.parse_args()
    target, head = str(paths.demo_target_dir()), str(paths.models_dir() / "demo-eagle3")
    model = ("--dtype", "float32", "--threads", "1")
    draft_args = ("draft-worker", "--model", head, "--target-model", target,
                  "--port", str(free_port()), *model)
    procs = [start_process(*draft_args, token=TOKEN)]
    procs.append(start_process("target-worker", "--model", target, "--draft-head", head,
                               "--draft-address", procs[0][1], *model, token=TOKEN))

    def restart() -> None:
        time.sleep(args.kill_after_s)
        procs[0][0].kill()
        procs[0][0].wait()
        procs.append(start_process(*draft_args, token=TOKEN))  # on the same port
    try:
        rounds = stream(procs[1][1], Tokenizer(target).encode("def fibonacci(n):\n"),
                        args.max_tokens, restart)
    finally:
        for proc, _ in procs:
            stop_process(proc)
    report(rounds)


def stream(address: str, prompt: list[int], max_tokens: int, meanwhile) -> list[tuple]:
    """(seconds into the stream, γ, accepted) per round."""
    params = SamplingParams()
    req = pb.TargetRequest(request_id="head-restart", prompt_ids=prompt, max_tokens=max_tokens,
                           sampling=sampling_to_proto(params, 1), ignore_eos=True,
                           spec_mode=pb.SPEC_MODE_FIXED, gamma=4, proposer="model")
    rounds, start = [], time.monotonic()
    threading.Thread(target=meanwhile, daemon=True).start()
    with grpc.insecure_channel(address) as channel:
        for chunk in worker_pb2_grpc.TargetStub(channel).Generate(
                req, metadata=token_metadata(TOKEN), timeout=300):
            rounds += [(time.monotonic() - start, r.gamma, r.num_accepted)
                       for r in chunk.rounds]
    return rounds


def report(rounds: list[tuple]) -> None:
    print("| seconds | rounds | draft tokens | accepted |\n|---|---|---|---|")
    n = len(rounds)
    for part in (rounds[i * n // 8:(i + 1) * n // 8] for i in range(8)):
        print(f"| {part[0][0]:.1f}-{part[-1][0]:.1f} | {len(part)} | "
              f"{sum(g for _, g, _ in part)} | {sum(a for _, _, a in part)} |")


if __name__ == "__main__":
    main()
