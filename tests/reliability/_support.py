"""What the reliability tests share: worker probes, resident memory, a private
redis-server, reference outputs and timing records."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from outrider.grpc_server import token_metadata
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

# figures the tests measured, one JSON object a line, for docs/RELIABILITY.md
FIGURES_FILE = os.environ.get("OUTRIDER_RELIABILITY_FIGURES")


def record(name: str, **figures) -> None:
    """Print a measured figure (pytest -s shows it) and append it to
    $OUTRIDER_RELIABILITY_FIGURES when set."""
    line = json.dumps({"name": name, **figures}, sort_keys=True)
    print(f"[reliability] {line}", flush=True)
    if FIGURES_FILE:
        with open(FIGURES_FILE, "a") as out:
            out.write(line + "\n")


def queued_bytes(sock: socket.socket) -> int:
    """Bytes the client's kernel holds that the client has not read (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def rss_kb(pid: int) -> int:
    """Resident memory of a process (VmRSS in /proc/PID/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Workers:
    """gRPC stubs of one target replica and one draft replica, with the cluster token."""

    target_address: str
    draft_address: str | None
    token: str

    def __post_init__(self) -> None:
        self._channels = [grpc.insecure_channel(self.target_address)]
        self.target = worker_pb2_grpc.TargetStub(self._channels[0])
        self.draft = None
        if self.draft_address:
            self._channels.append(grpc.insecure_channel(self.draft_address))
            self.draft = worker_pb2_grpc.DraftStub(self._channels[1])

    def load(self) -> pb.Load:
        return self.target.GetLoad(pb.LoadRequest(), metadata=token_metadata(self.token),
                                   timeout=10)

    def draft_stats(self) -> pb.DraftStats | None:
        if self.draft is None:
            return None
        return self.draft.Stats(pb.DraftStatsRequest(), metadata=token_metadata(self.token),
                                timeout=10)

    def held(self) -> dict[str, int]:
        load, stats = self.load(), self.draft_stats()
        return {"num_running": load.num_running, "num_waiting": load.num_waiting,
                "kv_used_blocks": load.kv_used_blocks,
                "draft_sequences": stats.num_sequences if stats else 0}

    def wait_idle(self, timeout_s: float = 20.0) -> float:
        """Seconds until nothing is held: no running or waiting sequence, every KV block
        free, no draft sequence; raises AssertionError with what is still held."""
        start = time.monotonic()
        held = self.held()
        while any(held.values()):
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"still held {timeout_s:.0f} s after the work ended: "
                                     f"{held}")
            time.sleep(0.1)
            held = self.held()
        return time.monotonic() - start

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


class RedisServer:
    """A redis-server of this test's own on a fixed loopback port, to stop, freeze
    (SIGSTOP) and restart; `appendonly` keeps its data across restarts."""

    def __init__(self, port: int, data_dir: Path, appendonly: bool = False) -> None:
        self.port, self.data_dir, self.appendonly = port, data_dir, appendonly
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        import redis

        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make test installs it)"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no",
             "--appendfsync", "always", "--dir", str(self.data_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        for _ in range(200):
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)


def reference_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target model's own greedy tokens, in this process (no speculation): what
    every greedy request must produce whatever happens to the serving processes."""
    from outrider.core.sampling import SamplingParams
    from outrider.engine.runner import ModelRunner, RunnerConfig
    from outrider.engine.spec_decode import SpeculativeDecoder

    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(model_dir))))
    outputs = decoder.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0)
    return [list(o.output_ids) for o in outputs]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> float:
    """Seconds until predicate() is true; raises AssertionError after timeout_s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not true after {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - start
