"""`outrider target-worker`: one target replica (a TP group) as a gRPC server."""

from __future__ import annotations

import sys
import threading
import uuid

from outrider.target_worker.engine import TargetEngine
from outrider.target_worker.remote_drafter import RemoteDrafter
from outrider.target_worker.scheduler import SchedulerConfig
from outrider.target_worker.service import TargetService

from outrider.dense_channel import TARGET_RANK, DenseChannel
from outrider.engine.distributed import TPRunnerGroup
from outrider.engine.runner import RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.grpc_server import build_server, serve_until_signalled
from outrider.v1 import worker_pb2_grpc
from outrider.v1.worker_pb2 import DESCRIPTOR

SERVICE_NAME = DESCRIPTOR.services_by_name["Target"].full_name


def serve(runner_cfg: RunnerConfig, sched_cfg: SchedulerConfig, draft_addresses: list[str],
          gamma: int, host: str, port: int, token: str | None,
          dist_address: str | None = None, overlap_max_seqs: int = 0) -> None:
    group = TPRunnerGroup(runner_cfg)
    channel = DenseChannel(dist_address, TARGET_RANK) if dist_address else None
    if channel and not channel.wait_ready(timeout_s=60):
        print("dense q channel did not come up; full-vocabulary q goes as fp16 over gRPC",
              file=sys.stderr, flush=True)
    drafter = (RemoteDrafter(draft_addresses, token, seq_prefix=f"{uuid.uuid4().hex[:8]}:",
                             dense_channel=channel)
               if draft_addresses else None)
    decoder = SpeculativeDecoder(group.runner, drafter, overlap_max_seqs=overlap_max_seqs)
    engine = TargetEngine(decoder, sched_cfg)
    service = TargetService(engine, default_gamma=gamma if drafter else 0)
    # every open stream holds a handler thread: room for a full batch, Cancel and GetLoad
    server, bound = build_server(
        lambda s: worker_pb2_grpc.add_TargetServicer_to_server(service, s),
        [SERVICE_NAME], f"{host}:{port}", token, max_workers=sched_cfg.max_num_seqs + 16)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,), name="target-engine", daemon=True)
    loop.start()
    # the engine keeps running while streams in flight drain, then stops
    serve_until_signalled(server, "target worker", f"{host}:{bound}")
    stop.set()
    loop.join(timeout=10)
    group.close()
    if drafter:
        drafter.close()
