"""Starting Outrider server processes as children of this process: `outrider serve`,
benchmarks and system tests use it. `Supervisor` keeps them running (`outrider serve`)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

LISTENING = re.compile(r"listening on (\S+:\d+)")
START_TIMEOUT_S = 120.0  # of silence before a process says it listens


class NotListening(RuntimeError):
    """A server process that exited, or printed nothing for too long, before saying it
    listens."""

    def __init__(self, output: list[str]) -> None:
        super().__init__("server did not start:\n" + "".join(output[-20:]))
        self.last_line = next((line.strip() for line in reversed(output) if line.strip()), "")


class RoleFailed(RuntimeError):
    """A supervised process kept dying and was given up."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised process that died is started again (docs/RELIABILITY.md,
    "Supervision"): after a delay that doubles from `first_delay_s` up to `max_delay_s`
    with each death in a row; the death after `max_restarts` in a row gives it up. A run
    that stayed up `stable_s` ends the row (its death is a first one again)."""

    first_delay_s: float = 0.5
    max_delay_s: float = 8.0
    max_restarts: int = 5
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("restart delays must satisfy 0 < first_delay_s <= max_delay_s")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def delay_s(self, num_in_row: int) -> float:
        """The wait before the restart that follows death number `num_in_row` (1, 2, ...)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (num_in_row - 1))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_process(*args: str, token: str | None = None, timeout: float = START_TIMEOUT_S,
                  echo: str | None = None, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """Run `outrider ARGS...`; returns (process, 'host:port') once it says it listens
    (raises NotListening, the process stopped, if it does not). Its later output is
    printed with the prefix `echo`, or dropped (never left to fill the pipe)."""
    proc = _spawn(args, token, env)
    return proc, _await_listening(proc, timeout, echo)


@contextmanager
def outrider_process(*args: str, token: str | None = None, timeout: float = START_TIMEOUT_S,
                     echo: str | None = None, env: dict[str, str] | None = None):
    """start_process as a context: yields (process, 'host:port'); stops the process on exit."""
    proc, address = start_process(*args, token=token, timeout=timeout, echo=echo, env=env)
    try:
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


@contextmanager
def supervised_group(token: str | None = None, env: dict[str, str] | None = None,
                     policy: RestartPolicy = RestartPolicy(),
                     on_give_up: Callable[[], None] = lambda: None):
    """process_group whose processes are kept running (Supervisor). Yields
    start(name, *args, echo=None) -> 'host:port'. Leaving stops them all, the last started
    first, and raises RoleFailed if one was given up."""
    supervisor = Supervisor(token, env, policy, on_give_up)
    try:
        yield supervisor.start
    finally:
        supervisor.stop()
    if supervisor.failure:
        raise RoleFailed(supervisor.failure)


@dataclass
class _Kept:
    """A supervised process: the arguments that start it again on the port it first
    listened on, the process running it now, and how its runs ended."""

    name: str
    args: tuple[str, ...]
    echo: str | None
    proc: subprocess.Popen
    listening_since: float | None = None   # monotonic; None: this run never listened
    start_failure: str = ""                # this run's last output line, when it never listened
    num_deaths_in_row: int = 0
    thread: threading.Thread | None = None

    def count_death(self, stable_s: float) -> int:
        """Deaths in a row: a run that stayed up `stable_s` starts the count again."""
        up_s = time.monotonic() - self.listening_since if self.listening_since else 0.0
        self.num_deaths_in_row = 1 if up_s >= stable_s else self.num_deaths_in_row + 1
        return self.num_deaths_in_row

    def describe_death(self) -> str:
        """'router (pid N) was killed by SIGKILL', with what it said when it never listened."""
        before = f" before listening ({self.start_failure})" if self.start_failure else ""
        return f"{self.name} (pid {self.proc.pid}) {_exit_status(self.proc.returncode)}{before}"


class Supervisor:
    """Keeps `outrider` processes running. One thread per process waits for it: a process
    that dies is reaped at once (no zombie), logged, and started again with the same
    arguments on the same port, where clients and the other processes find it again,
    after RestartPolicy's delay. One that keeps dying is given up: `failure` says which
    and `on_give_up` is called (`outrider serve` then stops everything)."""

    def __init__(self, token: str | None, env: dict[str, str] | None,
                 policy: RestartPolicy, on_give_up: Callable[[], None]) -> None:
        self.policy = policy
        self.failure: str | None = None
        self._token, self._env = token, env
        self._on_give_up = on_give_up
        self._stopping = threading.Event()
        # a restart's spawn against stop(): stop() sees every process that was spawned
        self._lock = threading.Lock()
        self._kept: list[_Kept] = []

    def start(self, name: str, *args: str, echo: str | None = None) -> str:
        """Start `outrider ARGS...` as `name` and keep it running; returns 'host:port'. A
        first start that fails raises: there is nothing to keep."""
        proc, address = start_process(*args, token=self._token, env=self._env, echo=echo)
        # flags parse last-wins: the restarts take the port the first run got (it may be 0)
        kept = _Kept(name, (*args, "--port", address.rsplit(":", 1)[1]), echo, proc,
                     listening_since=time.monotonic())
        kept.thread = threading.Thread(target=self._keep, args=(kept,), name=f"keep-{name}",
                                       daemon=True)
        self._kept.append(kept)
        kept.thread.start()
        return address

    def stop(self) -> None:
        """Stop every process, the last started first, restarting none meanwhile."""
        self._stopping.set()
        for kept in reversed(self._kept):
            with self._lock:
                proc = kept.proc
            stop_process(proc)
        for kept in self._kept:
            kept.thread.join()

    def _keep(self, kept: _Kept) -> None:
        while True:
            kept.proc.wait()  # reaps it
            if self._stopping.is_set():
                return
            num = kept.count_death(self.policy.stable_s)
            if num > self.policy.max_restarts:
                self._give_up(kept)
                return
            delay_s = self.policy.delay_s(num)
            _log(f"{kept.describe_death()}; restart {num} in a row "
                 f"(at most {self.policy.max_restarts}) in {delay_s:g} s")
            if self._stopping.wait(delay_s):
                return
            self._restart(kept)

    def _restart(self, kept: _Kept) -> None:
        """Start it again. A start that fails leaves `kept.proc` exited: a death like any
        other. Stopping meanwhile leaves the dead process in place."""
        with self._lock:
            if self._stopping.is_set():
                return
            kept.proc = _spawn(kept.args, self._token, self._env)
        kept.listening_since, kept.start_failure = None, ""
        try:
            _await_listening(kept.proc, START_TIMEOUT_S, kept.echo)
        except NotListening as exc:
            kept.start_failure = exc.last_line
            return
        kept.listening_since = time.monotonic()
        _log(f"{kept.name} (pid {kept.proc.pid}) listening again")

    def _give_up(self, kept: _Kept) -> None:
        message = (f"{kept.name} kept dying and was given up after "
                   f"{kept.num_deaths_in_row} deaths in a row (none up "
                   f"{self.policy.stable_s:g} s); last: {kept.describe_death()}")
        _log(message)
        self.failure = self.failure or message
        self._on_give_up()


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_status(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # a signal the enum lacks (real-time ones)
        return f"was killed by signal {-code}"


def _log(line: str) -> None:
    print(f"[supervisor] {line}", file=sys.stderr, flush=True)


def _spawn(args: tuple[str, ...], token: str | None,
           env: dict[str, str] | None) -> subprocess.Popen:
    env = dict(os.environ, **(env or {}), OUTRIDER_CLUSTER_TOKEN=token or "")
    return subprocess.Popen([sys.executable, "-m", "outrider.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _await_listening(proc: subprocess.Popen, timeout: float, echo: str | None) -> str:
    """Its address once it says it listens (NotListening, the process stopped, if it
    exits first or prints nothing for `timeout` s: a start that keeps saying what it does,
    a long load or a layer search, is given the time it takes; a silent hang is not)."""
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_output, args=(proc, lines, echo), daemon=True).start()
    try:
        return _wait_listening(lines, timeout)
    except BaseException:
        stop_process(proc)
        raise


def _read_output(proc: subprocess.Popen, lines: queue.Queue, echo: str | None) -> None:
    """Every line it prints: into `lines` until it says it listens (None at its end),
    then printed with the prefix `echo`, or dropped (never left to fill the pipe)."""
    listening = False
    for line in proc.stdout:
        if not listening:
            lines.put(line)
            listening = LISTENING.search(line) is not None
        elif echo is not None:
            print(f"{echo}{line}", end="", flush=True)
    lines.put(None)


def _wait_listening(lines: queue.Queue, timeout: float) -> str:
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise NotListening([*seen, f"nothing printed for {timeout:.0f} s\n"]) from None
        if line is None:
            raise NotListening(seen)
        seen.append(line)
        if match := LISTENING.search(line):
            return match.group(1)
