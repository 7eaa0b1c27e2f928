"""Shared test setup: where Triton kernels can run, hypothesis profiles.

Kernel tests take the ``kernel_device`` fixture: "cuda" where a GPU is present, otherwise "cpu"
when ``TRITON_INTERPRET=1`` is in the environment (the README's test command sets it), so CI runs
the kernels' logic through the interpreter. Tests that need CUDA itself use ``requires_cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from kvops._config import interpreting

HAS_CUDA = torch.cuda.is_available()
KERNEL_DEVICES = ["cuda"] if HAS_CUDA else (["cpu"] if interpreting() else [])

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _share_the_cores() -> None:
    """Under pytest-xdist, give each worker its share of the cores for torch's CPU threads.
    Every worker otherwise starts one OpenMP thread per core, so ``-n 16`` on 16 cores runs 256
    spinning threads, and the float64 oracles' small CPU ops (a Python loop of them per query)
    run a hundred times slower than alone: a 0.8 s oracle took over 200 s on a 16-core GPU
    host."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // int(workers)))


_share_the_cores()

settings.register_profile(
    "ci", deadline=None, max_examples=25, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                          HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                          HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("KVOPS_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny matmuls: a second thread only adds
    synchronization, and on a shared 2-core machine two threads run many times slower. Use
    with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Launch rules and plans are cached per shape; tests that patch a rule's constants or the
    device properties must not see another test's cached choice."""
    import sys

    from kvops.kernels import elastic_attention, static_sliding_attention

    for name, mod in list(sys.modules.items()):
        if name.startswith("kvops.kernels.") and isinstance(getattr(mod, "_PLANS", None), dict):
            mod._PLANS.clear()
    elastic_attention.elastic_launch.cache_clear()
    static_sliding_attention.sliding_launch.cache_clear()
    yield


@pytest.fixture(params=KERNEL_DEVICES or [None], ids=lambda d: f"kernel-{d}")
def kernel_device(request):
    """The device Triton kernels run on here; skips when neither CUDA nor the interpreter is on."""
    if request.param is None:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    return torch.device(request.param)


@pytest.fixture
def poison():
    """Make every ``torch.empty`` inside the test return NaN (ints: INT_MAX), so an output element
    a kernel forgets to write shows up as NaN instead of passing by luck."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def capture_graph(fn):
    """Run ``fn`` once on a side stream (capture needs its kernels compiled and the allocator
    warm), then capture one call of it in a CUDA graph. Returns ``(graph, the captured call's
    output)``; replaying the graph reruns ``fn`` on whatever its input buffers hold then."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def counting_backend():
    """A torch.compile backend that counts compilations: ``(backend, calls)``; compile with
    ``backend`` and assert ``len(calls) == 1`` after many steps to prove zero recompiles."""
    from torch._dynamo.backends.registry import lookup_backend

    inductor, calls = lookup_backend("inductor"), []

    def backend(gm, example_inputs):
        calls.append(1)
        return inductor(gm, example_inputs)

    return backend, calls


def two_launches(module, monkeypatch):
    """Make ``module``'s launcher merge by a second launch, as under capture: its split outputs
    come without counters."""
    split = module.split_outputs
    monkeypatch.setattr(module, "split_outputs", lambda *a: (*split(*a)[:4], None))


class LaunchSpy:
    """Stands in for a triton kernel: records each launch's grid and keywords, then launches.
    Tests patch it over a kernel module's kernel to check the launcher's own choices."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (on the CPU, whatever their devices)."""
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


@pytest.fixture(autouse=True)
def _fresh_recipes():
    """Each test starts without replay recipes (kvops/ops/_replay.py): a test that patches a
    launch rule or a kernel must see its patch run, not a recipe recorded before it."""
    from kvops.ops import _replay

    _replay.refresh()
    yield
