"""The two ways a split launch merges its splits (``kvops.kernels._splitk``): in the same launch,
by the last split of each group (eager calls), and by a second launch (CUDA-graph capture).
Both against the float64 oracles for both decode ops, paged prefill and far_page_select, with
empty and NaN rows; the counters a one-launch merge takes are zero again after it; a plan's
first eager call also loads the two-launch form; on CUDA, two streams and two threads get
disjoint scratch and counters, and launches overlapping on two streams count apart."""

from __future__ import annotations

import pytest
import torch

import kvops  # noqa: F401  (registers the ops)
from kvops.kernels import _splitk, _workspace
from kvops.kernels import elastic_attention as ea
from kvops.kernels import static_sliding_attention as ssa
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from tests.conftest import requires_cuda, two_launches
from tests.test_elastic_attention import check_against_oracle as elastic_check
from tests.test_elastic_attention import make_case as elastic_case
from tests.test_static_sliding_attention import check_against_oracle as sliding_check
from tests.test_static_sliding_attention import make_case as sliding_case

MERGES = ["one launch", "two launches"]


def _force(module, merge, monkeypatch):
    """Make ``module``'s launcher merge as ``merge`` says; returns the counters its
    ``split_outputs`` hands it."""
    given = []
    make = module.split_outputs
    if merge == "two launches":
        two_launches(module, monkeypatch)
    else:
        def refuse(*a):
            raise AssertionError("a one-launch merge launched the merge kernel")

        def keep(*a):
            outs = make(*a)
            given.append(outs[4])
            return outs

        monkeypatch.setattr(module, "split_outputs", keep)
        monkeypatch.setattr(_splitk, "merge_split_outputs", refuse)
        # the one-launch form alone (the first call of a plan also runs the two-launch form:
        # test_first_eager_call_also_loads_the_capture_form)
        monkeypatch.setattr(_splitk, "load_capture_form", lambda ready: False)
    return given


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("num_splits,C", [(3, 0), (5, 0), (4, 9)])
def test_sliding_merges_match_the_oracle(kernel_device, merge, num_splits, C, monkeypatch):
    given = _force(ssa, merge, monkeypatch)
    dims = (3, 100, 2, 3, 64, C, torch.float16)
    case = sliding_case(*dims, device=kernel_device, seed=num_splits + C, empty_rows=(1,))
    out, lse = ssa.static_sliding_attention_fwd(**case, num_splits=num_splits)
    sliding_check(out, lse, case, dims[-1], f"{merge}-splits{num_splits}-C{C}")
    assert len(given) == (merge == "one launch")
    for count in given:
        assert count.shape == (3 * 2,) and not count.any()      # left zero for the next launch


@pytest.mark.parametrize("merge", MERGES)
def test_sliding_nan_rows_stay_nan(kernel_device, merge, monkeypatch):
    """A win_len outside [0, W] makes its row NaN (the op's documented answer) through either
    merge; its neighbours stay exact."""
    _force(ssa, merge, monkeypatch)
    dims = (3, 64, 2, 2, 32, 0, torch.float32)
    case = sliding_case(*dims, device=kernel_device, seed=5)
    case["win_len"][0] = 64 + 3
    out, lse = ssa.static_sliding_attention_fwd(**case, num_splits=4)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert not out[1:].isnan().any() and not lse[1:].isnan().any()
    rest = {n: t[1:] for n, t in case.items()}
    sliding_check(out[1:], lse[1:], rest, dims[-1], f"{merge}-nan-neighbours")


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("path,S", [("native", 16), ("structured", 16), ("general", 16),
                                    ("general", 8)])
def test_elastic_merges_match_the_oracle(kernel_device, merge, path, S, monkeypatch):
    """S 8 on the general path: per-row page ids, so the table kernel runs first and (compiled
    on Hopper) the main kernel launches behind it with programmatic dependent launch."""
    given = _force(ea, merge, monkeypatch)
    case = elastic_case(4, 5, S, 2, 4, 64, torch.float16, path, kernel_device, seed=len(path),
                        zero_row=True)
    out, lse = ea.elastic_attention_fwd(**case, num_splits=3)
    elastic_check(out, lse, case, f"{merge}-{path}")
    assert len(given) == (merge == "one launch")
    for count in given:
        assert count.shape == (4 * 2,) and not count.any()


def test_one_launch_and_two_agree(kernel_device, monkeypatch):
    """The two merges sum the splits in different orders: equal to float32 rounding."""
    dims = (2, 130, 2, 4, 64, 0, torch.float32)
    case = sliding_case(*dims, device=kernel_device, seed=11)
    one = ssa.static_sliding_attention_fwd(**case, num_splits=5)
    two_launches(ssa, monkeypatch)
    two = ssa.static_sliding_attention_fwd(**case, num_splits=5)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@requires_cuda
def test_eager_calls_merge_in_one_launch_and_leave_kept_counters_zero(monkeypatch):
    """Eager split calls of both ops on CUDA never launch the merge kernel, and every kept
    counter is zero after them."""
    dev = torch.device("cuda")
    refuse = lambda *a: (_ for _ in ()).throw(AssertionError("merge kernel launched"))
    monkeypatch.setattr(_splitk, "merge_split_outputs", refuse)
    monkeypatch.setattr(_splitk, "load_capture_form", lambda ready: False)
    _workspace.clear()
    for seed in range(3):
        case = sliding_case(4, 4096, 8, 4, 128, 0, torch.bfloat16, dev, seed=seed)
        ssa.static_sliding_attention_fwd(**case, num_splits=8)
        paged = elastic_case(3, 40, 16, 2, 4, 128, torch.bfloat16, "structured", dev, seed=seed)
        ea.elastic_attention_fwd(**paged, num_splits=6)
    torch.cuda.synchronize()
    assert _workspace._COUNTS
    for buf, _ in _workspace._COUNTS.values():
        assert not buf.any()


@requires_cuda
def test_overlapping_launches_on_two_streams_count_apart():
    """Stream a's launch has far more programs than fit on the GPU at once, so its groups are
    counted over its whole run, while stream b's short launches start and finish: counters or
    scratch shared with b would merge a's groups early or never and leave counters non-zero."""
    dev = torch.device("cuda")
    long = sliding_case(64, 1 << 16, 1, 4, 128, 0, torch.float16, dev, seed=1)
    short = [sliding_case(2, 2048, 1, 4, 128, 0, torch.float16, dev, seed=2 + i)
             for i in range(8)]
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    for c in (long, *short):           # compiled (both forms) before the overlapping launches
        ssa.static_sliding_attention_fwd(**c, num_splits=16)
    torch.cuda.synchronize()
    with torch.cuda.stream(sa):
        got_long = ssa.static_sliding_attention_fwd(**long, num_splits=16)
    got_short = []
    with torch.cuda.stream(sb):
        for c in short:
            got_short.append(ssa.static_sliding_attention_fwd(**c, num_splits=16))
    torch.cuda.synchronize()
    for c, got in ((long, got_long), *zip(short, got_short)):   # too long for the oracle
        want = static_sliding_attention_ref(**c)
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=2e-3)
    for buf, _ in _workspace._COUNTS.values():
        assert not buf.any()


@requires_cuda
def test_streams_and_threads_get_disjoint_scratch_and_counters():
    """split_scratch hands two streams, and two threads on one stream, buffers that share no
    byte (the float views and the counters)."""
    import threading

    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = ((2, 8, 4, 64), (2, 8, 4))
    got = []
    for stream in (torch.cuda.Stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            got.append(_workspace.split_scratch(dev, shapes, 16))
    other = threading.Thread(target=lambda: got.append(_workspace.split_scratch(dev, shapes, 16)))
    other.start()
    other.join()
    got.append(_workspace.split_scratch(dev, shapes, 16))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for views in got for t in views)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


@pytest.mark.parametrize("module", ["sliding", "elastic", "prefill"])
def test_first_eager_call_also_loads_the_capture_form(kernel_device, module, monkeypatch):
    """A plan's first eager call runs the two-launch form (so a later capture finds its kernels
    loaded) and then the one launch; later calls run the one launch only."""
    import kvops.kernels.paged_prefill_attention as ppa
    from tests.conftest import LaunchSpy
    from tests.test_paged_prefill_attention import make_case as prefill_case

    mod, name = {"sliding": (ssa, "_sliding_window_kernel"),
                 "elastic": (ea, "_elastic_decode_kernel"),
                 "prefill": (ppa, "_paged_prefill_kernel")}[module]
    spy = LaunchSpy(getattr(mod, name))
    monkeypatch.setattr(mod, name, spy)
    merges = []
    merge = _splitk.merge_split_outputs
    monkeypatch.setattr(_splitk, "merge_split_outputs",
                        lambda *a: (merges.append(1), merge(*a)))
    if module == "sliding":
        case = sliding_case(2, 100, 2, 3, 64, 0, torch.float16, kernel_device, seed=3)
        call = lambda: ssa.static_sliding_attention_fwd(**case, num_splits=3)
    elif module == "elastic":
        case = elastic_case(2, 5, 16, 2, 4, 64, torch.float16, "structured", kernel_device, 3)
        call = lambda: ea.elastic_attention_fwd(**case, num_splits=3)
    else:
        case = prefill_case([(40, 3), (9, 5)], 16, 2, 4, 64, torch.float16, kernel_device,
                            seed=3, window=0)
        call = lambda: ppa.paged_prefill_attention_fwd(**case, num_splits=3, block_n=16)
    first = [t.clone() for t in call()]
    assert [kw["FUSED_MERGE"] for _, kw in spy.launches] == [False, True] and merges == [1]
    spy.launches.clear()
    second = call()
    assert [kw["FUSED_MERGE"] for _, kw in spy.launches] == [True] and merges == [1]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("N", [5, 70, 200])
def test_page_select_in_one_launch_equals_two(kernel_device, N, monkeypatch):
    """far_page_select's one-launch form (the last scoring block of a row chooses) gives the
    scoring and choice kernels' answer bit for bit, rows of one to four scoring blocks, and
    leaves its counters zero."""
    import kvops.kernels.far_page_select as fps
    from tests.test_far_page_ops import make_select_case

    q, lo, hi, num_far = make_select_case(3, N, 2, 4, 64, torch.float16, kernel_device, N)
    num_far[0] = N
    given = []
    scratch = fps.split_scratch

    def keep(*a):
        got = scratch(*a)
        given.append(got[-1])
        return got

    monkeypatch.setattr(fps, "split_scratch", keep)
    one = fps.far_page_select_fwd(q, lo, hi, num_far, min(6, N))
    assert len(given) == 1 and given[0] is not None and not given[0].any()
    monkeypatch.setattr(fps, "split_scratch", lambda *a: (*scratch(*a)[:-1], None))
    two = fps.far_page_select_fwd(q, lo, hi, num_far, min(6, N))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("merge", MERGES)
def test_prefill_merges_match_the_oracle(kernel_device, merge, monkeypatch):
    """paged_prefill_attention's split tiles through either merge, padding rows and a table
    hole included (padding rows get their zeros straight from every split in one launch)."""
    import kvops.kernels.paged_prefill_attention as ppa
    from tests.test_paged_prefill_attention import check_against_oracle as prefill_check
    from tests.test_paged_prefill_attention import make_case as prefill_case

    given = _force(ppa, merge, monkeypatch)
    case = prefill_case([(70, 9), (0, 5), (33, 17)], 16, 2, 4, 64, torch.float16,
                        kernel_device, seed=12, window=0, pad=2, hole=True)
    out, lse = ppa.paged_prefill_attention_fwd(**case, num_splits=3, block_n=16)
    prefill_check(out, lse, case, f"{merge}-prefill", 0)
    assert len(given) == (merge == "one launch")
    for count in given:
        assert not count.any()


@requires_cuda
def test_page_select_in_one_launch_at_the_choice_cap(monkeypatch):
    """The one-launch far_page_select compiled with the 16-warp choice inside the scoring
    kernel, at rows of ``CHOICE_MAX_PAGES`` pages, equals the two kernels."""
    import kvops.kernels.far_page_select as fps
    from tests.test_far_page_ops import make_select_case

    N = fps.CHOICE_MAX_PAGES
    q, lo, hi, num_far = make_select_case(2, N, 2, 4, 64, torch.bfloat16, "cuda", 7)
    num_far[:] = N
    one = fps.far_page_select_fwd(q, lo, hi, num_far, 64)
    scratch = fps.split_scratch
    monkeypatch.setattr(fps, "split_scratch", lambda *a: (*scratch(*a)[:-1], None))
    two = fps.far_page_select_fwd(q, lo, hi, num_far, 64)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
