"""Eager cost of every op beside SDPA's on the same tensors: host us a call, wall us a call,
and graph-replay us.

- host us/call: time the host spends in a call (N calls back to back, timed before the
  device sync; shapes are small so the device never holds the host back);
- wall us/call: the same loop timed through the final sync;
- graph us: the median CUDA-graph replay time of one call (``bench.common.time_graph``).

Host time drifts with the machine (an SDPA call took 15 to 29 us within one run), so each row
interleaves rounds of the op, its peer and SDPA and reports medians and the medians of the
rounds' ratios.

The attention rows use Llama-3-8B heads (Hq 32, Hkv 8, D 128), bf16, B 4, 512 tokens (pages of
16). Copy and pool ops use the same pool; their peers are torch's own indexing ops.

On a CPU machine the bench times every op's CUDA host path with the compiled kernel's launch
faked (``cuda_path_on_cpu``): the dispatcher, the checks, the plans, the allocations and the
launch glue, beside SDPA's whole call on one-token CPU tensors.

    python3 -m bench.bench_eager            # writes bench/results/<date>-<HHMM>-eager.md on CUDA
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

import kvops  # noqa: F401  (registers the ops)
from bench.common import eager_times
from kvops.ops import _replay

HQ, HKV, D, S = 32, 8, 128, 16
LOOP = dict(iters=1000, warmup=30)      # timed back-to-back calls, and warm-up calls before them


def cases(device, dtype=torch.bfloat16, B=4, ctx=512):
    """name -> (op call, peer name, peer call) on shared tensors."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    L = ctx // S
    P = B * L + 4
    q = rnd(B, HQ, D)
    k, v = rnd(B, ctx, HKV, D), rnd(B, ctx, HKV, D)
    ws = torch.zeros(B, dtype=torch.int32, device=device)
    wl = torch.full((B,), ctx, dtype=torch.int32, device=device)
    kc, vc = rnd(P, S, HKV, D), rnd(P, S, HKV, D)
    table = torch.arange(B * L, dtype=torch.int32, device=device).view(B, L)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=device)
    span = torch.tensor([[2, 6]] * B, dtype=torch.int32, device=device)
    q4 = q.unsqueeze(2)
    kd, vd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)
    Q = 8
    k_out, v_out = rnd(Q, S, HKV, D), rnd(Q, S, HKV, D)
    trains = torch.tensor([[0, 0, 4], [10, 4, 4]], dtype=torch.int32, device=device)
    num = torch.tensor([2], dtype=torch.int32, device=device)
    src = torch.arange(8, device=device)
    chunks = torch.arange(B * 2 * 4, dtype=torch.int32, device=device).view(B, 2, 4)
    pairs = torch.tensor([[0, 1, 0], [2, 3, 2]], dtype=torch.int32, device=device)
    from kvops.layouts import codecs

    back_dtype = codecs.backing_dtype(codecs.default_codec(dtype), dtype)
    backing = torch.empty(2, 2, S, HKV, D, dtype=back_dtype, device=device)
    slots = torch.arange(B, dtype=torch.int32, device=device) * S
    q_start = torch.arange(B + 1, dtype=torch.int32, device=device)
    # the chunk's own K/V rows (random: validation mode, which checks the pool holds them,
    # would refuse them; timing reads no values)
    k_rows, v_rows = rnd(B, HKV, D), rnd(B, HKV, D)
    ops = torch.ops.kvops
    # far-page retrieval (kvops.runtime.FarRetrieval): N far pages a sequence, top 8 of them
    N, K = L, 8
    k_min, k_max = rnd(B, N, HKV, D), rnd(B, N, HKV, D)
    num_far = torch.full((B,), N, dtype=torch.int32, device=device)
    far_pages = torch.arange(B * N, dtype=torch.int32, device=device).view(B, N)
    new = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)]).to(
        device=device, dtype=torch.int32)
    index = torch.full((B, K), -1, dtype=torch.int32, device=device)
    far_k, far_v = rnd(B, K * S, HKV, D), rnd(B, K * S, HKV, D)
    far_bias = torch.zeros(B, K * S, dtype=torch.float32, device=device)
    n_layers, C = 2, 8
    scores = torch.rand(n_layers, B, L + 1, generator=g).to(device)
    summarized = torch.ones(B, L, dtype=torch.bool, device=device)
    select = torch.arange(C, dtype=torch.int32, device=device).expand(n_layers, B, C).contiguous()

    other = torch.roll(new, 1, 0).contiguous()     # another choice a sequence
    # the mean far view's utility update: C far summaries a sequence
    obs_k = rnd(B, C, HKV, D)
    obs_bias = torch.zeros(B, C, dtype=torch.float32, device=device)
    obs_lse = torch.full((B, HQ), 4.0, dtype=torch.float32, device=device)

    def slot_update():      # alternates two choices, so every call copies pages
        ops.far_slot_update(new, table, kc, vc, index, far_k, far_v, far_bias)
        ops.far_slot_update(other, table, kc, vc, index, far_k, far_v, far_bias)

    return {
        "static_sliding_attention": (lambda: ops.static_sliding_attention(q, k, v, ws, wl),
                                     "sdpa", sdpa),
        "elastic_attention (native)": (lambda: ops.elastic_attention(q, kc, vc, table, seq),
                                       "sdpa", sdpa),
        "elastic_attention (structured)": (
            lambda: ops.elastic_attention(q, kc, vc, table, seq, base_span=span), "sdpa", sdpa),
        "paged_gather_merged": (lambda: ops.paged_gather_merged(kc, vc, trains, num, k_out, v_out),
                                "index_select x2",
                                lambda: (kc.index_select(0, src), vc.index_select(0, src))),
        "far_view_summarize": (lambda: ops.far_view_summarize(kc, vc, chunks), "sdpa", sdpa),
        "pack_base_pairs": (lambda: ops.pack_base_pairs(kc, pairs, backing), "sdpa", sdpa),
        "refine_base_pairs": (lambda: ops.refine_base_pairs(kc, pairs, backing), "sdpa", sdpa),
        "paged_kv_write": (lambda: ops.paged_kv_write(q[:, :HKV], q[:, :HKV], kc, vc, slots),
                           "index_put_ x2", lambda: (kc.view(-1, HKV, D).index_put_((slots.long(),),
                                                                               q[:, :HKV]),
                                                     vc.view(-1, HKV, D).index_put_((slots.long(),),
                                                                               q[:, :HKV]))),
        "paged_prefill_attention": (
            lambda: ops.paged_prefill_attention(q, kc, vc, table, q_start, seq), "sdpa", sdpa),
        # as the engine calls it: the chunk's own K/V rows given (the Gluon kernel on sm_90)
        "paged_prefill_attention (chunk rows)": (
            lambda: ops.paged_prefill_attention(q, kc, vc, table, q_start, seq, k=k_rows,
                                                v=v_rows), "sdpa", sdpa),
        "far_page_summarize": (lambda: ops.far_page_summarize(kc, far_pages), "sdpa", sdpa),
        "far_page_select": (lambda: ops.far_page_select(q, k_min, k_max, num_far, K), "sdpa",
                            sdpa),
        "far_slot_update (two calls)": (slot_update, "sdpa x2", lambda: (sdpa(), sdpa())),
        "far_view_rank": (lambda: ops.far_view_rank(scores, summarized, select), "sdpa", sdpa),
        "far_view_observe": (lambda: ops.far_view_observe(q, obs_k, obs_bias, obs_lse,
                                                          select[0], scores[0]), "sdpa", sdpa),
    }


ROUNDS = 7     # interleaved rounds of (op, peer, sdpa): the host's speed drifts within a run


def cuda_rows():
    """One row an op: host and wall us the median over ``ROUNDS`` rounds, each timing the op,
    its peer and SDPA back to back, and the ratios the medians of the rounds' own ratios, so a
    drift of the host's speed between rows (SDPA 15-29 us a call within one run) cancels."""
    import statistics

    from bench.common import time_graph

    rows = []
    all_cases = cases(torch.device("cuda"))
    sdpa = all_cases["static_sliding_attention"][2]
    loop = dict(LOOP, iters=LOOP["iters"] // 2)
    cxx = _replay.module() if _replay.installed() else None
    for name, (op, peer_name, peer) in all_cases.items():
        per_round = []
        hits = cxx.stats()[0] if cxx else 0
        for _ in range(ROUNDS):
            per_round.append((*eager_times(op, **loop), *eager_times(peer, **loop),
                              eager_times(sdpa, **loop)[0]))
        # whether the op's timed calls replayed (the C++ kernel; "-": not installed)
        replayed = ("-" if cxx is None else
                    "yes" if cxx.stats()[0] - hits >= ROUNDS * loop["iters"] else "no")
        host, wall, p_host, p_wall, s_host = (statistics.median(c) for c in zip(*per_round))
        to_peer = statistics.median(r[0] / r[2] for r in per_round)
        to_sdpa = statistics.median(r[0] / r[4] for r in per_round)
        graph, p_graph = time_graph(op)[1], time_graph(peer)[1]
        rows.append([name, replayed, host, wall, graph, peer_name, p_host, p_wall, p_graph, s_host,
                     to_peer, to_sdpa])
        print(rows[-1], flush=True)
    headers = ["op", "replayed", "host us", "wall us", "graph us", "peer", "peer host us",
               "peer wall us", "peer graph us", "sdpa host us", "host / peer", "host / sdpa"]
    return headers, rows


# triton 3.6's launcher form for kernels with tensor descriptors, as
# ``kvops.kernels._launch._descriptor_entry`` reads it: the C entry, which descriptors the
# wrapper encodes and their metadata in its closure, the encoding and the count of the C entry's
# leading arguments in its module. Faked here, so a descriptor launch takes its direct form.
_BASE_ARGS_FORMAT_LEN = 13


def make_tensordesc_arg(desc, metadata):
    """The fake encoding of one descriptor: what the C entry would take for it."""
    return [None, *desc.shape, *desc.strides]


def _descriptor_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        return launcher(*args) if tensordesc_indices and tensordesc_meta else None
    return inner


class _FakeRun:
    """A compiled launcher whose C entry point takes any arguments and launches nothing, in
    the form of triton 3.6's wrapper over a kernel with six tensor descriptors (the Gluon
    prefill's)."""

    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0
    launch = staticmethod(_descriptor_wrapper(lambda *args: None, set(range(6)), [{}] * 6))

    def __call__(self, *args):
        pass


class _FakeCompiled:
    run, function, packed_metadata = _FakeRun(), 0, None


@contextlib.contextmanager
def cuda_path_on_cpu():
    """Run each op's CUDA host path on CPU tensors: the ops take their kernels (``use_triton``),
    the device looks like an H100 (132 SMs, sm_90), the JIT (or the interpreter) hands back a
    compiled kernel whose C launch does nothing, and the device and stream queries answer as a
    GPU's would (device 0, stream 0, not capturing), so ``kvops.kernels._workspace`` keeps split
    scratch per stream as there. Everything else runs as it does there: the checks and their
    signature cache, the launch plans and rules, the output allocations and the launch glue.
    The launch plans, kept binaries and scratch made inside are dropped on exit."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    import kvops.kernels
    import kvops.ops
    from kvops.kernels import _common, _launch, _workspace

    mods = [importlib.import_module(f"{pkg.__name__}.{m.name}")
            for pkg in (kvops.kernels, kvops.ops) for m in pkgutil.iter_modules(pkg.__path__)]
    props = _common.DeviceProps(132, 232448, (9, 0), True)
    fakes = dict(use_triton=lambda on: True, device_props=lambda device: props,
                 sm_count=lambda device: props.sms,
                 cuda_capability=lambda device: props.capability,
                 max_shared_memory=lambda device: props.smem,
                 nvidia_ptx=lambda device: True, hw_fp8=lambda device: True,
                 _is_cuda=lambda device: True, _default_pool=lambda t: True)
    patches = [(m, name, fake) for m in mods for name, fake in fakes.items() if hasattr(m, name)]
    patches += [(m, "_PLANS", {}) for m in mods if isinstance(getattr(m, "_PLANS", None), dict)]
    patches += [(_workspace, "_BUFS", {}), (_workspace, "_COUNTS", {})]
    # every triton kernel object (JIT, interpreted, Gluon) launches through KernelInterface
    patches += [(KernelInterface, "__getitem__", lambda kernel, grid: lambda *a, **kw: _FakeCompiled()),
                (_launch, "JITFunction", KernelInterface),
                (_launch, "_BINS", {}), (_launch, "_STATE", dict(_launch._STATE, direct=True)),
                (torch._C, "_cuda_getCurrentRawStream", lambda device: 0),
                (torch._C, "_cuda_isCurrentStreamCapturing", lambda: False),
                (torch._C, "_cuda_getDevice", lambda: 0)]
    missing = object()
    olds = []
    try:
        for obj, name, value in patches:
            olds.append((obj, name, getattr(obj, name, missing)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(olds):
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def cpu_rows():
    """Every op's CUDA host path on CPU tensors (``cuda_path_on_cpu``: checks, plans,
    allocations and launch glue as on a GPU, the compiled kernel's C launch faked), the best of
    three timed loops an op, beside SDPA's whole call on one-token CPU tensors. The CPU
    machines run this Python about twice as fast as the GPU machines' hosts; what it tracks is
    the Python an eager call adds."""
    tiny = [torch.randn(1, HQ, 1, D), torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D)]
    t_sdpa = eager_times(lambda: F.scaled_dot_product_attention(*tiny, enable_gqa=True), **LOOP)[0]
    rows = []
    with cuda_path_on_cpu():
        for name, (op, _, _) in cases(torch.device("cpu")).items():
            rows.append([name, min(eager_times(op, **LOOP)[0] for _ in range(3)), t_sdpa])
    return ["op", "host us (CUDA path, launch faked)", "sdpa host us (CPU, one token)"], rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="eager", help="the results file's name (default: eager)")
    ap.add_argument("--profile", action="store_true",
                    help="also print where static_sliding_attention's host time goes (cProfile)")
    args = ap.parse_args()
    from bench.common import table, write_result

    if torch.cuda.is_available():
        headers, rows = cuda_rows()
        text = table(headers, rows)
        kernel = ("the C++ replay kernel (kvops/ops/_replay.py)" if _replay.installed()
                  else "the Python implementations")
        path = write_result(args.name, "Llama-3-8B heads, bf16, B 4 x 512 (pages of 16). The ops' "
                            f"CUDA kernel: {kernel}.\n\n" + text)
    else:
        headers, rows = cpu_rows()
        text = table(headers, rows)
        path = None
    print(text)
    if path:
        print(f"wrote {path}")
    if args.profile:
        import cProfile
        import pstats

        cuda = torch.cuda.is_available()
        with contextlib.nullcontext() if cuda else cuda_path_on_cpu():
            op = cases(torch.device("cuda" if cuda else "cpu"))["static_sliding_attention"][0]
            eager_times(op, iters=200, warmup=30)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                op()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
