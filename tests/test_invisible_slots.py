"""No op's output depends on a slot that is not visible or not mapped, on any path: every such
slot is filled with NaN or inf (BASE bytes with 0x7F, NaN in both codecs) and the outputs must
equal those of the same call on clean data, for the PyTorch reference and the Triton kernel.

pack_base_pairs and refine_base_pairs have no invisible slots (they move the listed pages bit
for bit); their untouched pages are checked by tests/test_base_pairs.py.
"""

from __future__ import annotations

import pytest
import torch

import kvops
from kvops.ops.elastic_attention import span_modes
from tests.test_elastic_attention import make_case as elastic_case
from tests.test_static_sliding_attention import make_case as sliding_case

POISONS = [float("nan"), float("inf"), float("-inf")]


def _same(a, b, name):
    assert torch.equal(a, b) or torch.allclose(a, b, atol=0, rtol=0, equal_nan=True), name


@pytest.fixture(params=["reference", "kernel"])
def path(request):
    return request.param


def _device_backend(path, kernel_device):
    return ("cpu", "torch") if path == "reference" else (kernel_device, "triton")


@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("C", [0, 3])
def test_static_sliding_invisible_and_empty_far_slots(path, poison, C, kernel_device):
    device, backend = _device_backend(path, kernel_device)
    case = sliding_case(3, 24, 2, 2, 32, C, torch.float32, device, seed=7, empty_rows=(0,))
    if C:
        case["far_bias"][:, 0] = float("-inf")           # one empty far slot a row at least
    W = case["k"].shape[1]
    with kvops.backend(backend):
        clean = torch.ops.kvops.static_sliding_attention(**case)
        slot = torch.arange(W, device=device)
        rel = (slot[None, :] - case["win_start"].long()[:, None]) % W
        hidden = rel >= case["win_len"].long()[:, None]                       # [B, W]
        dirty = dict(case)
        for name in ("k", "v"):
            dirty[name] = case[name].masked_fill(hidden[:, :, None, None], poison)
        if C:
            empty = case["far_bias"] == float("-inf")
            for name in ("far_k", "far_v"):
                dirty[name] = case[name].masked_fill(empty[:, :, None, None], poison)
        got = torch.ops.kvops.static_sliding_attention(**dirty)
    _same(got[0], clean[0], "out")
    _same(got[1], clean[1], "lse")


def _poison_pool(case, modes, poison):
    """A copy of the pool with every slot no sequence reads set to ``poison`` (TARGET rows) or
    to the byte 0x7F (BASE halves)."""
    k, v = case["k_cache"], case["v_cache"]
    P, S, Hkv, D = k.shape
    table, lens = case["block_table"].cpu(), case["seq_lens"].cpu()
    keep_t = torch.zeros(P, S, dtype=torch.bool)
    keep_b = torch.zeros(P, 2, S, dtype=torch.bool)
    base_page = torch.zeros(P, dtype=torch.bool)
    for b in range(table.shape[0]):
        n = int(lens[b])
        for j in range(-(-n // S)):
            page, rows, m = int(table[b, j]), min(S, n - j * S), int(modes[b, j])
            if m == 0:
                keep_t[page, :rows] = True
            else:
                keep_b[page, m - 1, :rows] = True
                base_page[page] = True
    out = []
    for c in (k, v):
        c = c.clone()
        dev = c.device
        hide_t = (~keep_t & ~base_page[:, None]).to(dev)
        c.masked_fill_(hide_t[:, :, None, None], poison)
        if c.element_size() == 2:
            u8 = c.view(torch.uint8).view(P, 2, S, Hkv, D)
            hide_b = (~keep_b & base_page[:, None, None]).to(dev)
            u8.masked_fill_(hide_b[..., None, None], 0x7F)
        out.append(c)
    return out


@pytest.mark.parametrize("poison", POISONS[:2], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", ["native", "structured", "general"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_elastic_unread_rows_and_unmapped_pages(path, poison, kind, dtype, kernel_device):
    device, backend = _device_backend(path, kernel_device)
    case = elastic_case(3, 5, 8, 2, 2, 32, dtype, kind, device, seed=11, zero_row=True)
    L = case["block_table"].shape[1]
    if kind == "general":
        modes = case["block_mode"].cpu()
    elif kind == "structured":
        modes = span_modes(case["base_span"].cpu(), L)
    else:
        modes = torch.zeros(case["block_table"].shape, dtype=torch.int8)
    with kvops.backend(backend):
        clean = torch.ops.kvops.elastic_attention(**case)
        k, v = _poison_pool(case, modes, poison)
        got = torch.ops.kvops.elastic_attention(**dict(case, k_cache=k, v_cache=v))
    _same(got[0], clean[0], "out")
    _same(got[1], clean[1], "lse")


@pytest.mark.parametrize("poison", POISONS[:2], ids=["nan", "inf"])
def test_far_view_empty_chunks_and_bad_ids(path, poison, kernel_device):
    device, backend = _device_backend(path, kernel_device)
    g = torch.Generator().manual_seed(3)
    P, S, Hkv, D = 7, 8, 2, 16
    kc, vc = (torch.randn(P, S, Hkv, D, generator=g).to(device) for _ in range(2))
    # live chunks read pages 0, 1, 2 and an out-of-range id (zeros); the empty chunk names
    # page 5 after its -1; pages 3, 4, 5 and 6 are read by no live chunk
    table = torch.tensor([[[0, 1], [-1, 5]], [[2, 9], [6, -1]]], dtype=torch.int32)
    table[1, 1] = torch.tensor([-1, 6])
    table = table.to(device)
    with kvops.backend(backend):
        clean = torch.ops.kvops.far_view_summarize(kc, vc, table)
        hide = torch.tensor([False, False, False, True, True, True, True], device=device)
        dk = kc.masked_fill(hide[:, None, None, None], poison)
        dv = vc.masked_fill(hide[:, None, None, None], poison)
        got = torch.ops.kvops.far_view_summarize(dk, dv, table)
    _same(got[0], clean[0], "k_sum")
    _same(got[1], clean[1], "v_sum")


@pytest.mark.parametrize("poison", POISONS[:2], ids=["nan", "inf"])
def test_gather_unused_rows_and_pages(path, poison, kernel_device):
    device, backend = _device_backend(path, kernel_device)
    g = torch.Generator().manual_seed(4)
    P, Q, S, Hkv, D = 10, 6, 8, 2, 16
    kc, vc = (torch.randn(P, S, Hkv, D, generator=g).to(device) for _ in range(2))
    # used rows copy pages 0-1 -> 0-1 and 4 -> 3; the row past num_trains names page 7,
    # the invalid row (n 0) page 8; pages 2, 3 and 5-9 are read by no used row
    trains = torch.tensor([[0, 0, 2], [4, 3, 1], [8, 4, 0], [7, 5, 1]], dtype=torch.int32,
                          device=device)
    num = torch.tensor([3], dtype=torch.int32, device=device)
    hide = torch.ones(P, dtype=torch.bool, device=device)
    hide[[0, 1, 4]] = False
    outs = []
    with kvops.backend(backend):
        for k, v in ((kc, vc), (kc.masked_fill(hide[:, None, None, None], poison),
                                vc.masked_fill(hide[:, None, None, None], poison))):
            k_out = torch.zeros(Q, S, Hkv, D, device=device)
            v_out = torch.zeros(Q, S, Hkv, D, device=device)
            torch.ops.kvops.paged_gather_merged(k, v, trains, num, k_out, v_out)
            outs.append((k_out, v_out))
    _same(outs[1][0], outs[0][0], "k_out")
    _same(outs[1][1], outs[0][1], "v_out")
