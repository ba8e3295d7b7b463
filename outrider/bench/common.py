"""What the benchmarks share when they run: requests through the router's public API and
the deployment they measure (outrider.bench.serving and hf_peer), the flags' lists, the
targets a run states and judges, the draft/target cost ratio c measured in process, the
record of the machine; and what every harness's JSON says of itself (provenance: the
commit, date, command and machine of the run). Nothing here imports a benchmark."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from outrider import paths
from outrider.bench.prompts import workload_prompts  # noqa: F401 (scripts/served_ab.py)
from outrider.v1 import generate_pb2 as gp

TOKEN = "bench-token"  # cluster token of a deployment the harness starts itself
# the samplings a request may name (outrider.bench.acceptance measures α at three of them)
SETTINGS = {"greedy": dict(temperature=0.0),
            "t0.7-p0.9": dict(temperature=0.7, top_p=0.9),
            "t0.7-p0.95": dict(temperature=0.7, top_p=0.95),
            "t1.0": dict(temperature=1.0)}


# -- what to run ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """A speculation setting of the public API: OFF, FIXED with γ, or AUTO (γ_max 0 =
    the replica's default)."""

    name: str
    kind: int    # gp.SPECULATION_MODE_*
    gamma: int   # FIXED: γ; AUTO: γ_max; OFF: 0

    @classmethod
    def parse(cls, text: str) -> Mode:
        """'off', 'auto', 'auto8' (γ_max 8) or 'fixedN'."""
        if text == "off":
            return cls(text, gp.SPECULATION_MODE_OFF, 0)
        for prefix, kind in (("fixed", gp.SPECULATION_MODE_FIXED),
                             ("auto", gp.SPECULATION_MODE_AUTO)):
            rest = text.removeprefix(prefix)
            if text.startswith(prefix) and (rest.isdigit() or (rest == "" and prefix == "auto")):
                return cls(text, kind, int(rest or 0))
        raise ValueError(f"unknown mode {text!r}: use off, fixedN or auto[N]")


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_concurrency(text: str) -> list[int]:
    levels = [int(part) for part in parse_list(text)]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs positive integers, got {text!r}")
    return levels


def build_request(prompt: list[int], sampling: str, mode: Mode, max_tokens: int, seed: int,
                  tag: str) -> gp.GenerateRequest:
    options = SETTINGS[sampling]
    sampling_pb = gp.SamplingOptions(temperature=options["temperature"],
                                     max_tokens=max_tokens, ignore_eos=True, seed=seed)
    if "top_p" in options:
        sampling_pb.top_p = options["top_p"]
    return gp.GenerateRequest(token_ids=gp.TokenIds(ids=prompt), sampling=sampling_pb,
                              speculation=gp.SpeculationOptions(mode=mode.kind,
                                                                gamma_max=mode.gamma),
                              tag=tag, include_rounds=True)


def tag_for(workload: str, sampling: str) -> str:
    """Acceptance statistics (AUTO's prior) are kept per tag: one per workload and
    sampling, so greedy code does not inherit sampled prose's acceptance."""
    return f"bench-{workload}-{sampling}"


# -- one request ---------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """What the client saw of one streamed request."""

    start: float
    end: float = 0.0
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    rounds: list[tuple[int, int]] = field(default_factory=list)    # (γ, accepted)
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_rounds: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.deltas)

    @property
    def ttft(self) -> float:
        return self.deltas[0][0] - self.start


def stream_request(stub, request: gp.GenerateRequest, metadata=(),
                   timeout_s: float = 600) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    for msg in stub.GenerateStream(request, metadata=metadata, timeout=timeout_s):
        now = time.perf_counter()
        if msg.token_ids:
            record.deltas.append((now, len(msg.token_ids)))
            record.token_ids += msg.token_ids
        record.rounds += [(r.gamma, r.num_accepted) for r in msg.rounds]
        if msg.finish_reason:
            spec = msg.speculation
            record.completion_tokens = msg.usage.completion_tokens
            record.draft_tokens, record.accepted_tokens = spec.draft_tokens, spec.accepted_tokens
            record.num_rounds = spec.rounds
    record.end = time.perf_counter()
    return record


# -- targets -------------------------------------------------------------------------------
def target(name: str, value: float | None, threshold: float, higher_is_better: bool = True,
           **where) -> dict:
    """A stated target and whether the measured value meets it (None: not measured)."""
    met = None if value is None else (value >= threshold if higher_is_better
                                      else value <= threshold)
    return {"target": name, "value": value, "threshold": threshold,
            "higher_is_better": higher_is_better, "met": met, **where}


def print_targets(targets: list[dict]) -> None:
    """One line per target: met or MISS, its value against its threshold."""
    for t in targets:
        print(f"{'met ' if t['met'] else 'MISS'} {t['target']} (c={t.get('concurrency')}): "
              f"{t['value']:.3g} vs {t['threshold']:.3g}" if t["value"] is not None else
              f"---- {t['target']}: not measured")


# -- c: the cost of a forward in process ---------------------------------------------------
def decode_forward_seconds(runner, context_len: int, repeats: int = 50,
                           feature_width: int = 0) -> float:
    """Median time of one single-token decode forward at batch 1 after `context_len` tokens
    (a head's: with features of `feature_width`, zeros) of a ModelRunner or HeadRunner."""
    import torch

    from outrider.engine.runner import ForwardRequest

    blocks, seq_id = runner.blocks, "cost-probe"
    blocks.append(seq_id, context_len)
    features = (lambda n: torch.zeros(n, feature_width)) if feature_width else (
        lambda n: None)
    runner.forward([ForwardRequest([1] * context_len, 0, blocks.block_table(seq_id), 1,
                                   features(context_len))])
    times = []
    for _ in range(repeats):
        blocks.append(seq_id, 1)
        start = time.perf_counter()
        runner.forward([ForwardRequest([1], context_len, blocks.block_table(seq_id), 1,
                                       features(1))])
        times.append(time.perf_counter() - start)
        blocks.rollback(seq_id, context_len)
    blocks.free(seq_id)
    return statistics.median(times)


# -- the deployment, the machine -----------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    router: str
    target: str | None = None   # known only when the harness started the replica
    token: str | None = None


@contextmanager
def deployment(args) -> Iterator[Deployment]:
    """The router at --address, or a local one (router + target + draft processes on
    --target/--draft) started here and stopped on exit."""
    if args.address:
        yield Deployment(args.address)
        return
    from outrider.local_system import LocalSystemConfig, local_system

    cfg = LocalSystemConfig(args.target, args.draft, gamma=args.replica_gamma, grpc_port=0,
                            max_batch_tokens=args.max_batch_tokens)
    with local_system(cfg, TOKEN) as system:
        yield Deployment(system.router, system.target, TOKEN)


def call_metadata(api_key: str | None) -> tuple:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or
            platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(), "cpu_pressure_at_start": cpu_pressure()}


def cpu_pressure() -> str | None:
    """Linux PSI: the share of time some task waited for a CPU (10 s / 60 s / 300 s
    averages): how busy the machine was with other work."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `python -m outrider.bench.<module> ...` or `outrider ...`."""
    argv = sys.argv if argv is None else argv
    program = Path(argv[0]).name
    if Path(argv[0]).parent.name == "scripts":  # the repository's scripts/
        return f"python scripts/{program} {shlex.join(argv[1:])}".strip()
    if program.endswith(".py") and program not in ("cli.py", "__main__.py"):  # (-m outrider.cli)
        return f"python -m outrider.bench.{program[:-3]} {shlex.join(argv[1:])}".strip()
    return f"outrider {shlex.join(argv[1:])}".strip()


# -- provenance: what every result file says of itself ---------------------------------------
def provenance(argv: list[str] | None = None) -> dict:
    """The commit, UTC date, command and machine of a run, for its JSON's `provenance`
    (BENCHMARKS.md's tables name them); a harness takes it as its run begins. No torch
    import: the facts come from files."""
    argv = list(sys.argv if argv is None else argv)
    return {"commit": git_commit(), "dirty": git_dirty(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command_line(argv), "argv": argv, "machine": machine_facts()}


def git_commit(cwd: Path = paths.REPO_ROOT) -> str | None:
    """`git rev-parse --short HEAD` of the checkout, or None outside one."""
    return _git(cwd, "rev-parse", "--short", "HEAD")


def git_dirty(cwd: Path = paths.REPO_ROOT) -> bool | None:
    """Whether tracked files other than the documentation and results differ from the
    commit (the run measured code the commit does not hold)."""
    status = _git(cwd, "status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":!*.md", ":!results", ":!docs")
    return None if status is None else bool(status)


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_facts() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"),
            "cpu_pressure": cpu_pressure()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
