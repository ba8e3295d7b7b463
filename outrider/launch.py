"""Starting Outrider server processes as children of this process: `outrider serve`,
benchmarks and system tests use it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager

LISTENING = re.compile(r"listening on (\S+:\d+)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def outrider_process(*args: str, token: str | None = None, timeout: float = 120,
                     echo: str | None = None, env: dict[str, str] | None = None):
    """Run `outrider ARGS...`; yields (process, 'host:port') once it says it listens.
    Its later output is printed with the prefix `echo`, or dropped (never left to fill
    the pipe)."""
    env = dict(os.environ, **(env or {}), OUTRIDER_CLUSTER_TOKEN=token or "")
    proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = _wait_listening(proc, timeout)
        threading.Thread(target=_drain, args=(proc, echo), daemon=True).start()
        yield proc, address
    finally:
        stop_process(proc)


@contextmanager
def redis_server(data_dir: str):
    """A throwaway redis-server on a free loopback port (no persistence); yields its URL.
    Benchmarks and tests use it; a deployment brings its own Redis."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server; "
                           "`make test` installs it)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", data_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def process_group(token: str | None = None, env: dict[str, str] | None = None):
    """Several `outrider` processes that stop together (the last started first). Yields
    start(*args, echo=None) -> (process, 'host:port')."""
    with ExitStack() as stack:
        def start(*args: str, echo: str | None = None):
            return stack.enter_context(outrider_process(*args, token=token, env=env, echo=echo))
        yield start


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drain(proc: subprocess.Popen, echo: str | None) -> None:
    for line in proc.stdout:
        if echo is not None:
            print(f"{echo}{line}", end="", flush=True)


def _wait_listening(proc: subprocess.Popen, timeout: float) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if match := LISTENING.search(line):
            return match.group(1)
    raise RuntimeError("server did not start:\n" + "".join(seen[-20:]))
