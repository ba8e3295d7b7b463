"""`outrider up / status / down`: reach Ray (an existing cluster, or a local one started
on demand), and drive the controller."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from outrider.cluster.spec import ClusterSpec, load_spec

LOCAL_HEAD_MARK = Path("/tmp/outrider-ray-head")  # written when `up` started the local head


def up(spec_path: str, address: str | None) -> tuple[dict, float]:
    """Bring the system up; returns (endpoints, seconds taken)."""
    import ray
    from outrider.cluster.controller import NAME, NAMESPACE, Controller

    start = time.perf_counter()
    spec = with_absolute_paths(load_spec(spec_path), Path(spec_path).parent)
    started_ray = connect(address, required_cpus(spec))
    token = os.environ.get("OUTRIDER_CLUSTER_TOKEN") or secrets.token_urlsafe(24)
    controller = ray.remote(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=8).remote(spec.model_dump(), token, started_ray)
    endpoints = ray.get(controller.up.remote())
    return endpoints, time.perf_counter() - start


def controller(address: str | None):
    """The running controller's handle, or None."""
    import ray
    from outrider.cluster.controller import NAME, NAMESPACE

    connect(address, 0, start_if_missing=False)
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def down(address: str | None) -> bool:
    """Drain and remove everything `up` made; stop the local Ray head if `up` started it.
    False when nothing was running."""
    import ray

    try:
        handle = controller(address)
    except ConnectionError:  # no Ray here at all
        return False
    if handle is None:
        return False
    started_ray = ray.get(handle.status.remote())["started_ray"]
    ray.get(handle.down.remote())
    ray.kill(handle)
    if started_ray:
        stop_local_head()
    return True


def connect(address: str | None, num_cpus: float, start_if_missing: bool = True) -> bool:
    """ray.init to `address`, or to the local head (started when missing and allowed);
    True when this call started the head."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace="outrider", logging_level="ERROR")
        return False
    try:
        ray.init(address="auto", namespace="outrider", logging_level="ERROR")
        return False
    except ConnectionError:
        if not start_if_missing:
            raise ConnectionError("no Ray cluster is running here (and none given with "
                                  "--address)") from None
    start_local_head(num_cpus)
    ray.init(address="auto", namespace="outrider", logging_level="ERROR")
    return True


# Ray starts its workers at nice 15, to keep its own daemons responsive; Outrider's
# replicas are those workers, and beside any other load they starved (a tp=2 target
# took over 600 s to start on a busy 2-core machine, 30 s alone)
SERVING_ENV = {"RAY_worker_niceness": "0"}


def start_local_head(num_cpus: float) -> None:
    """A Ray head on this machine that outlives this command; logical CPUs enough for
    the spec even on a small machine (the OS shares the cores)."""
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    cpus = max(os.cpu_count() or 1, math.ceil(num_cpus))
    from outrider.launch import free_port

    # not Ray's default GCS port 6379: that is Redis's, and the spec's Redis may be here
    done = subprocess.run([ray_bin, "start", "--head", f"--port={free_port()}",
                           f"--num-cpus={cpus}", "--num-gpus=0", "--include-dashboard=false",
                           "--disable-usage-stats", "--object-store-memory=200000000"],
                          capture_output=True, text=True, env={**os.environ, **SERVING_ENV})
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError("`ray start --head` failed: " + " / ".join(tail))
    LOCAL_HEAD_MARK.write_text(str(time.time()))


def stop_local_head() -> None:
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    subprocess.run([ray_bin, "stop", "--force"], capture_output=True, text=True, timeout=120)
    LOCAL_HEAD_MARK.unlink(missing_ok=True)


def required_cpus(spec: ClusterSpec) -> float:
    return sum(_pair_cpus(pair) for pair in spec.models) + spec.router.resources.cpus


def _pair_cpus(pair) -> float:
    targets = pair.target_replicas * pair.tp * pair.target_resources.cpus
    drafts = pair.target_replicas * max(pair.drafts_per_target,
                                        pair.autoscale.max_drafts if pair.autoscale.enabled
                                        else 0) * pair.draft_resources.cpus
    return targets + drafts


def with_absolute_paths(spec: ClusterSpec, base: Path) -> ClusterSpec:
    """Model dirs relative to the spec file become absolute (workers start elsewhere)."""
    def resolve(path: str | None) -> str | None:
        if path is None or Path(path).is_absolute():
            return path
        here = (base / path).resolve()
        return str(here if here.exists() else Path(path).resolve())
    return spec.model_copy(update={"models": [
        pair.model_copy(update={"target": resolve(pair.target), "draft": resolve(pair.draft)})
        for pair in spec.models]})
