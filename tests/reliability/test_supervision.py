"""`outrider serve` keeps its processes running: a router, target or draft process that
dies is reaped, logged and started again on its port; one that keeps dying stops
everything and `serve` exits non-zero naming it; SIGTERM still stops everything with 0
(docs/RELIABILITY.md, "Supervision"). Real `outrider serve` processes on the shipped demo
pair."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from outrider import launch, paths
from outrider.client import Client, OutriderError
from outrider.core.stats import MODEL_METHOD
from outrider.launch import RestartPolicy, free_port
from tests.reliability._support import record

PROMPT = "import os\n"
LISTENING = "outrider serve: router listening on "


@dataclass
class Serve:
    """A running `outrider serve`, its output in `log`."""

    proc: subprocess.Popen
    address: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pid_of(self, role: str) -> int:
        """The pid of its child running `outrider ROLE` (router, target-worker, draft-worker)."""
        (pid,) = [pid for pid, argv in children(self.proc.pid).items() if argv[3] == role]
        return pid

    def wait_for_log(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(pattern, self.text())):
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text()[-3000:]}"
            time.sleep(0.1)
        return match

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def start_serve(log: Path, *args: str) -> Serve:
    """`outrider serve ARGS` on a free port with a small KV cache, once its router listens."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", "serve", "--grpc-port",
                                 str(port), "--host", "127.0.0.1", "--kv-cache-mb", "8",
                                 "--no-http", *args],
                                stdout=out, stderr=subprocess.STDOUT)
    serve = Serve(proc, f"127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    while LISTENING not in serve.text():
        assert proc.poll() is None and time.monotonic() < deadline, serve.text()[-3000:]
        time.sleep(0.1)
    return serve


def children(pid: int) -> dict[int, list[str]]:
    """pid -> argv of every child of `pid` (from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
        if ppid == pid:
            found[int(stat.parent.name)] = argv
    return found


def state(pid: int) -> str | None:
    """Its state letter in /proc (Z: a zombie nobody reaped), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def generate_within(address: str, timeout_s: float, **options):
    """The first generation that succeeds, retried until `timeout_s`; (it, seconds taken)."""
    start = time.monotonic()
    with Client(address) as client:
        while True:
            left_s = timeout_s - (time.monotonic() - start)
            try:
                result = client.generate(PROMPT, max_tokens=8, temperature=0.0,
                                         timeout_s=max(0.1, left_s), **options)
                return result, time.monotonic() - start
            except OutriderError as exc:
                assert left_s > 0, f"no generation within {timeout_s} s: {exc}"
                time.sleep(0.2)


def kill(serve: Serve, role: str) -> int:
    pid = serve.pid_of(role)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    running = start_serve(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield running
    finally:
        running.stop()


def test_restart_delays_double_to_a_cap():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=8.0)
    assert [policy.delay_s(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 8, 8]


def starting(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_start_that_reports_progress_is_waited_for_and_a_silent_one_is_not():
    """The start timeout bounds silence, not the start: a process that prints a line a
    second for three times the timeout (a long load, a layer search) is waited for; one
    that prints nothing is stopped after the timeout, though its pipe stays open."""
    progressing = starting("import time\nfor i in range(6): print(i, flush=True); "
                           "time.sleep(0.5)\nprint('listening on 127.0.0.1:5', flush=True)\n"
                           "time.sleep(30)")
    start = time.monotonic()
    assert launch._await_listening(progressing, 1.0, None) == "127.0.0.1:5"
    assert time.monotonic() - start > 2.5
    launch.stop_process(progressing)
    silent = starting("import time; time.sleep(30)")
    start = time.monotonic()
    with pytest.raises(launch.NotListening, match="nothing printed for 1 s"):
        launch._await_listening(silent, 1.0, None)
    assert time.monotonic() - start < 10 and silent.poll() is not None


@pytest.mark.slow
def test_a_killed_router_is_reaped_logged_and_restarted(serve):
    generate_within(serve.address, 30)
    pid = kill(serve, "router")
    _, took_s = generate_within(serve.address, 20)
    assert state(pid) != "Z"
    serve.wait_for_log(rf"router \(pid {pid}\) was killed by SIGKILL; restart 1 in a row", 5)
    assert serve.pid_of("router") != pid
    record("supervision: router SIGKILLed, kill -> a generation succeeds", seconds=took_s)


@pytest.mark.slow
def test_a_killed_target_replica_is_restarted_and_serves_again(serve):
    """A restarted target loads its model, builds its oneDNN shapes and measures its cost
    model before it listens (7.6 s to a generation alone here): the bound leaves room for
    the three other test workers that share the 2 cores."""
    pid = kill(serve, "target-worker")
    _, took_s = generate_within(serve.address, 60)
    assert state(pid) != "Z"
    serve.wait_for_log(rf"target \(pid {pid}\) was killed by SIGKILL; restart 1 in a row", 5)
    record("supervision: target SIGKILLed, kill -> a generation succeeds", seconds=took_s)


@pytest.mark.slow
def test_a_killed_draft_replica_is_restarted_and_drafts_again(serve):
    pid = kill(serve, "draft-worker")
    start = time.monotonic()
    serve.wait_for_log(rf"draft-0 \(pid {pid}\) was killed by SIGKILL; restart 1 in a row", 5)
    while True:  # the target retries the replica it set aside every 0.5 s
        result, _ = generate_within(serve.address, 10, speculation="fixed", gamma_max=3)
        if result.speculation.by_proposer.get(MODEL_METHOD, (0, 0))[0]:  # not lookups
            break
        assert time.monotonic() - start < 30, "the target never drafted again"
        time.sleep(0.2)
    record("supervision: draft SIGKILLed, kill -> drafted tokens again",
           seconds=time.monotonic() - start)


@pytest.mark.slow
def test_sigterm_stops_every_process_and_exits_0(serve):
    # a role killed by an earlier test may still be waiting out its restart delay
    deadline = time.monotonic() + 30
    while len(pids := list(children(serve.proc.pid))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == 3
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(timeout=60) == 0
    assert [state(pid) for pid in pids] == [None] * 3
    after = serve.text().split("outrider serve: stopping", 1)[1]
    assert "[supervisor]" not in after


@pytest.mark.slow
def test_a_role_that_keeps_dying_stops_serve_with_an_error(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(paths.demo_target_dir(), target)
    serve = start_serve(tmp_path / "serve.log", "--target", str(target),
                        "--draft", str(paths.demo_draft_dir()))
    try:
        pids = list(children(serve.proc.pid))
        shutil.rmtree(target)  # the router reads it at start: every restart fails
        kill(serve, "router")
        start = time.monotonic()
        code = serve.proc.wait(timeout=75)
        record("supervision: router unable to start, kill -> serve exited",
               seconds=time.monotonic() - start)
        errors = [line for line in serve.text().splitlines()
                  if line.startswith("outrider: error:")]
        assert code != 0 and len(errors) == 1, serve.text()[-3000:]
        num_deaths = RestartPolicy().max_restarts + 1
        assert f"router kept dying and was given up after {num_deaths} deaths" in errors[0]
        assert [state(pid) for pid in pids] == [None] * 3
    finally:
        serve.stop()
