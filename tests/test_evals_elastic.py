"""The ElasticKV quality evaluation (kvops.evals.elastic) on a tiny random model: which blocks
are BASE, that cap 0 is TARGET exactly, that BASE moves the logits, and that the block-parallel
attention is what elastic_attention reads from a packed pool."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import kvops
from kvops.evals import elastic as ev
from kvops.models import Llama, LlamaConfig

TINY = LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   hidden_dim=96, rope_base=10000.0, max_seq_len=512)
CASES = [(torch.float16, "hi8"), (torch.float16, "hi8r"), (torch.bfloat16, "e4m3")]


@pytest.fixture(scope="module")
def model():
    # std 0.2: attention far from uniform, so BASE rounding of K shows in the output
    return Llama.random(TINY, seed=3, std=0.2)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY.vocab_size, (160,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype,codec", CASES)
def test_cap_zero_is_the_target_result_exactly(model, ids, dtype, codec):
    spans = ev.base_spans(len(ids), 0.0)
    assert int((spans[:, 1] - spans[:, 0]).abs().sum()) == 0
    got = ev.logits(model, ids, spans, dtype, codec)
    target = ev.logits(model, ids, None, dtype, codec)
    assert torch.equal(got, target)
    # and TARGET is the model's causal forward with K/V, q and the output rounded to dtype
    want = model(ids[None])[0].float()
    rel = ((target - want).norm() / want.norm()).item()
    assert rel < 3e-2, rel


@pytest.mark.parametrize("cap", [0.05, 0.10, 0.20])
def test_base_share_equals_the_cap_on_the_blocks_fidelity_demotes(cap):
    S, live = ev.PAGE, 40
    spans = ev.base_spans(live * S, cap, S, protect_first=1, protect_recent=2)
    last, _ = ev.exposure(spans)
    assert last == cap                    # 40 blocks: 2, 4, 8 BASE blocks, whole pairs
    lives = (torch.arange(live * S) + S) // S
    base = spans[:, 1] - spans[:, 0]
    assert bool((base <= cap * lives + 1e-9).all())                  # a cap, never exceeded
    assert bool((base % 2 == 0).all())                               # whole pairs
    on = base > 0
    assert bool((spans[on, 0] == 1).all())                           # oldest after the sink
    # never the last protect_recent = 2 blocks (the one being written among them)
    assert bool((spans[on, 1] <= lives[on] - 2).all())
    # once 20 blocks are live, exactly the largest even count under the cap
    late = lives >= 20
    want = 2 * torch.floor(cap * lives[late] / 2 + 1e-9).long()
    assert torch.equal(base[late].long(), want)


def test_all_base_spans_every_block():
    spans = ev.base_spans(50, 1.0, 16)
    assert spans[:, 0].eq(0).all() and torch.equal(spans[:, 1], (torch.arange(50) + 16) // 16)
    assert ev.exposure(spans) == (1.0, 1.0)


@pytest.mark.parametrize("dtype,codec", CASES)
def test_more_exposure_moves_the_logits_more(model, ids, dtype, codec):
    target = ev.logits(model, ids, None, dtype, codec)
    spans = ev.base_spans(len(ids), 0.2)
    got = ev.logits(model, ids, spans, dtype, codec)
    no_base = int((spans[:, 1] > 0).nonzero()[0])     # first position that reads BASE
    # causal: positions before the first BASE read are untouched, bit for bit
    assert torch.equal(got[:no_base], target[:no_base])
    diff = lambda x: (x[no_base:] - target[no_base:]).norm().item()
    assert diff(got) > 0
    all_base = ev.logits(model, ids, ev.base_spans(len(ids), 1.0), dtype, codec)
    assert diff(all_base) > diff(got)
    kl = lambda x: F.kl_div(x.log_softmax(-1), target.log_softmax(-1), log_target=True,
                            reduction="batchmean").item()
    assert kl(all_base) > kl(got) > 0


@pytest.mark.parametrize("dtype,codec", CASES)
def test_block_parallel_attention_is_what_elastic_attention_reads(model, ids, dtype, codec):
    """Against the op over pools packed by pack_base_pairs (an odd all-BASE span included):
    within an output rounding of the dtype (the two paths sum in different orders)."""
    T = 100                                    # 7 blocks: all-BASE spans of odd length
    for cap in (0.2, 1.0):
        spans = ev.base_spans(T, cap)
        assert ev.check_op(model, ids[:T], spans, dtype, codec, positions=3) < 2 ** -7


def test_block_parallel_attention_is_what_the_elastic_kernel_reads(model, ids, kernel_device):
    """The same through the Triton kernel (interpreted on CPU, compiled on a GPU), structured
    path."""
    spans = ev.base_spans(64, 1.0)
    # the model runs on the CPU: the triton backend only for the interpreter, whose kernels
    # take CPU tensors; on a GPU the op's CUDA tensors take the kernel by default
    on_cpu = kernel_device.type == "cpu"
    with kvops.backend("triton") if on_cpu else contextlib.nullcontext():
        err = ev.check_op(model, ids[:64], spans, torch.float16, "hi8r", positions=2,
                          device=kernel_device)
    assert err < 2 ** -7


def test_prefix_reuse_equals_a_full_pass(model, ids):
    spans = ev.base_spans(len(ids), 0.2)
    full, kvs = ev.hidden_states_from(model, ids, spans, torch.bfloat16, "e4m3")
    part, _ = ev.hidden_states_from(model, ids, spans, torch.bfloat16, "e4m3", start=90,
                                    cache=kvs)
    torch.testing.assert_close(part, full[90:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [-0.1, 1.5, True, "0.2", None, float("nan")])
def test_cap_outside_zero_one_is_refused(cap):
    with pytest.raises(ValueError, match="cap: expected a number in \\[0, 1\\]"):
        ev.check_case(torch.float16, "hi8", cap)
    with pytest.raises(ValueError, match="cap"):
        ev.base_spans(32, cap)


def test_unknown_codec_and_codec_of_the_other_dtype_are_refused():
    with pytest.raises(ValueError, match="codec: expected one of \\('hi8', 'hi8r'\\)"):
        ev.check_case(torch.float16, "hi9", 0.1)
    with pytest.raises(ValueError, match="codec: expected one of \\('hi8', 'hi8r'\\).*'e4m3'"):
        ev.check_case(torch.float16, "e4m3", 0.1)
    with pytest.raises(ValueError, match="codec: expected one of \\('e4m3',\\).*'hi8'"):
        ev.check_case("bfloat16", "hi8", 0.1)
    with pytest.raises(TypeError, match="codec: expected a codec name"):
        ev.check_case(torch.bfloat16, None, 0.1)
    with pytest.raises(TypeError, match="dtype: BASE codecs need float16 or bfloat16"):
        ev.check_case(torch.float32, "hi8", 0.1)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        ev.check_case("fp8", "hi8", 0.1)
    assert ev.check_case("float16", "hi8r", 0.05) == (torch.float16, "hi8r", 0.05)


def test_passkey_refuses_bad_arguments_before_any_work(model):
    with pytest.raises(ValueError, match="cap"):
        ev.passkey_hits(model, None, 256, 2, torch.float16, "hi8", 2.0)
    with pytest.raises(ValueError, match="codec"):
        ev.passkey_hits(model, None, 256, 2, torch.bfloat16, "hi8r", 0.1)
