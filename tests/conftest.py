from __future__ import annotations

import os
import shutil

# Without a GPU, the GPU's Triton kernels run on CPU tensors through Triton's interpreter
# (test_triton_attention.py). Triton reads this when it is first imported, which torch's
# compiler may do in any test, so it is set before all of them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs more processes than cores (4 workers, the systems they start): an OpenMP
# thread that spins after each parallel region, libgomp's default, burns the core another
# process waits for. Passive threads sleep at once: a cold `make test` on 2 cores took 666
# s and 1,241 CPU-s with them against 869 s and 1,441 CPU-s. Set before torch loads
# libgomp; the processes tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.checkpoints import perturbed_copy, save_random_checkpoint, train_tokenizer

# Test models are tiny: one thread is fastest, and leaves the other core to the
# processes (TP ranks, servers) that system tests start.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer_dir):
    """Llama with GQA and llama3 RoPE scaling."""
    from tests.checkpoints import LLAMA3_ROPE

    return save_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                  tokenizer_from=tokenizer_dir, rope_scaling=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, llama_dir):
    """A draft that agrees with llama_dir often but not always."""
    return perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), noise=0.15)


@pytest.fixture(scope="session")
def small_draft_dir(tmp_path_factory, tokenizer_dir):
    """An unrelated 1-layer draft with the same vocabulary (mostly rejected)."""
    return save_random_checkpoint(tmp_path_factory.mktemp("small_draft"), "llama", seed=7,
                                  tokenizer_from=tokenizer_dir, num_hidden_layers=1,
                                  hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port, for the whole session."""
    from outrider.launch import redis_server

    with redis_server(str(tmp_path_factory.mktemp("redis"))) as url:
        yield url


# -- parallel workers (make test: pytest-xdist, -n WORKERS) -----------------------------------

# A worker takes a whole group: by default a module, so a module-scoped system starts
# once. GROUPS names other groups by the start of their tests' node ids. Modules that must
# not run beside each other share one, which one worker runs in turn: the Ray tests each
# start and stop a local Ray, and `down` must find none left; the soak's 64 streams beside
# the Ray cluster's seven processes starve both on 2 cores (its tp=2 test took 312 s there,
# past the timeout, against 30 s alone). The chi-square module alone would be the suite's
# longest worker (~650 s of a cold 19-minute run), so its proposers' runs go to a second
# worker; its compiled case runs after test_compiled.py, whose graphs, the same, it then
# finds in the compiler's disk cache (23-34 s instead of 130-213 s on a machine that never
# compiled them). The first matching start wins.
CHI2 = "tests/engine/test_spec_distribution.py::test_"
GROUPS = {"tests/cluster/test_ray_cluster.py": "ray",
          "tests/cluster/test_up_down_cli.py": "ray",
          "tests/reliability/test_soak.py": "ray",
          "tests/engine/test_compiled.py": "compiled",
          f"{CHI2}compiled_": "compiled",
          **{f"{CHI2}{name}_": "chi2-proposers"
             for name in ("head", "tree", "lookup", "mixed", "constrained", "cache_aware",
                          "cached", "layer_skip", "cross_vocab")}}


# The longest groups (seconds of a cold run's worker), handed out first in this order:
# xdist's own order (most tests first) left the Ray group (~510 s) to start last.
LONGEST_FIRST = ("ray", "tests/engine/test_spec_distribution.py", "chi2-proposers",
                 "tests/reliability/test_hostile_input.py", "compiled",
                 "tests/reliability/test_supervision.py", "tests/reliability/test_failures.py",
                 "tests/workers/test_target_worker.py", "tests/test_cli.py",
                 "tests/reliability/test_overload.py", "tests/engine/test_batch_invariance.py")


def work_group(nodeid: str) -> str:
    """The group a test runs in: the first of GROUPS its node id starts with, else its
    module."""
    return next((group for start, group in GROUPS.items() if nodeid.startswith(start)),
                nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config, log):
    """Work handed out by work_group, in the collection's order (the mark-based `--dist
    loadgroup` does not group under this pytest: its workers rename items through an
    attribute pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_group(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST, then the other modules of system tests (marked slow), then the rest,
    so that no long group is handed out late and runs alone at the end."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, bool]:
        group = work_group(item.nodeid)
        first = LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, item.module not in slow

    items.sort(key=rank)  # stable: a group's tests keep their order
