"""ElasticKV fidelity on the transformers PagedCache: BASE blocks under ``generate``.

float16 models (BASE codecs need float16 or bfloat16; on the CPU float16 greedy tokens of the
tiny configs equal SDPA's, bfloat16's do not even without kvops). What must hold:

- fidelity attached, nothing demoted: greedy tokens equal SDPA's (the structured path over
  empty spans reads TARGET);
- after ``demote``: every decode step's logits equal, within float16 rounding, SDPA's over the K/V
  the cache must hold: the saved TARGET K/V with the demoted tokens replaced by
  ``codecs.decode(codecs.encode(x))`` (the oracle), and differ from SDPA's over plain TARGET by
  far more than that (the BASE bytes are what decode reads);
- after ``promote``: every row's K/V, read through its block table, equal the saved TARGET bytes
  bit for bit; a continuation (``T > 1``) promotes first and its tokens equal SDPA's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf (or test) extra")

import kvops  # noqa: E402
import kvops.integrations.transformers as kt  # noqa: E402
from kvops.layouts import codecs  # noqa: E402
from tests.test_transformers_integration import _config, _generate, _prompts  # noqa: E402

S = 8          # page size
# float16 logits of the tiny models are below 1 in magnitude, where a float16 ulp is <= 2**-11:
# kvops (float32 attention math) and SDPA over the same K/V differ by rounding only (measured
# <= 0.8 ulp on the CPU); 2 ulps of room, 4 on CUDA, whose SDPA kernels and kvops' Triton kernels
# accumulate in different orders. Demoting a third of the context moves the logits by ~1e-2 (hi8
# keeps 2 mantissa bits) or ~5e-3 (hi8r rounds), over 4x the rounding error seen (checked), so a
# decode that read TARGET where BASE is mapped (or the wrong half of a pair) fails the oracle.
ROUNDING = {"cpu": 2 * 2.0 ** -11, "cuda": 4 * 2.0 ** -11}
# a regression bound, not a derivation: the measured distance to TARGET (~1.1e-2) with 5x room
BASE_DRIFT = 5e-2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_MODELS: dict = {}


def _model16(arch: str = "llama", device="cpu"):
    if (arch, str(device)) not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(arch), attn_implementation="sdpa", dtype=torch.float16)
        _MODELS[arch, str(device)] = model.eval().to(device)
    return _MODELS[arch, str(device)]


def _fid_cache(model, **opts):
    return kt.PagedCache(model, batch_size=2, max_tokens=48, page_size=S,
                         fidelity=dict(min_batch=1, protect_recent=1, **opts))


def _held(cache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer's K/V of every row's held tokens, read through its committed pages."""
    lens = cache.state.seq_lens.tolist()
    out = []
    for layer in cache.layers:
        flat_k = layer.keys.reshape(-1, *layer.keys.shape[2:])
        flat_v = layer.values.reshape(-1, *layer.values.shape[2:])
        rows = []
        for b, n in enumerate(lens):
            pages = torch.tensor(cache.pager.pages(b), device=flat_k.device)
            i = torch.arange(n, device=flat_k.device)
            slots = pages[i // S] * S + i % S
            rows.append((flat_k[slots].clone(), flat_v[slots].clone()))
        out.append(rows)
    return out


def _oracle_cache(model, held, pads, spans, codec):
    """A DynamicCache (left-padded, transformers' layout) of the saved K/V, the tokens of each
    row's BASE span replaced by what its codec decodes to (``codec=None``: plain TARGET)."""
    dc = transformers.DynamicCache(config=model.config)
    T = pads[0] + held[0][0][0].shape[0]
    for n, rows in enumerate(held):
        k0 = rows[0][0]
        K = torch.zeros(len(rows), T, *k0.shape[1:], dtype=k0.dtype, device=k0.device)
        V = torch.zeros_like(K)
        for b, (k, v) in enumerate(rows):
            k, v = k.clone(), v.clone()
            first, end = spans[b]
            if codec is not None and end > first:
                part = slice(first * S, end * S)
                k[part] = codecs.decode(codecs.encode(k[part], codec)[0], k.dtype)
                v[part] = codecs.decode(codecs.encode(v[part], codec)[0], v.dtype)
            K[b, pads[b]:], V[b, pads[b]:] = k, v
        dc.update(K.transpose(1, 2).contiguous(), V.transpose(1, 2).contiguous(), n)
    return dc


def _step(model, impl, tok, mask, pos, cache):
    model.set_attn_implementation(impl)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(tok, attention_mask=mask, position_ids=pos, past_key_values=cache)
    return out.logits[:, -1].float()


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_fidelity_attached_nothing_demoted_tokens_equal_sdpa(arch):
    model = _model16(arch)
    ids, mask = _prompts()
    want = _generate(model, "sdpa", ids, mask)
    cache = _fid_cache(model)
    assert _generate(model, "kvops", ids, mask, cache).tolist() == want.tolist()
    assert cache.fidelity.stats["base_blocks"] == 0
    assert cache.state.base_span.abs().sum() == 0
    # one spare page beyond the reservation (promotion holds two pages a pair)
    assert cache.pager.num_pages == 2 * 6 + 1


def _demote_decode_promote(device, codec=None, backend=None, steps=4):
    model = _model16("llama", device)
    ids, mask = (t.to(device) for t in _prompts())
    cache = _fid_cache(model, codec=codec)
    out = _generate(model, "kvops", ids, mask, cache, max_new_tokens=24)
    with kvops.backend(backend or kvops.backend()):
        _check_demote_decode_promote(model, cache, mask, out, device, steps)


def _check_demote_decode_promote(model, cache, mask, out, device, steps):
    assert cache.state.seq_lens.tolist() == [11 + 23, 7 + 23]
    held = _held(cache)
    pads = (1 - mask).sum(1).tolist()

    # rows hold 34 and 30 tokens (4 and 3 full blocks of 8; the last block of each stays TARGET)
    free = cache.pager.free_pages
    assert cache.demote(pages=2) == 2
    spans = [cache.fidelity.span(b) for b in (0, 1)]
    assert spans == [(0, 2), (0, 2)]
    assert cache.pager.free_pages == free + 2
    assert cache.state.base_span.tolist() == [[0, 2], [0, 2]]

    codec = cache.fidelity.codec
    oracle = _oracle_cache(model, held, pads, spans, codec)
    target = _oracle_cache(model, held, pads, spans, None)
    tok = out[:, -1:]
    full_mask = torch.cat([mask, torch.ones_like(out)], 1)
    pos = torch.tensor([[34], [30]], device=device)
    drift = err = 0.0
    for _ in range(steps):
        got = _step(model, "kvops", tok, full_mask, pos, cache)
        want = _step(model, "sdpa", tok, full_mask, pos, oracle)
        plain = _step(model, "sdpa", tok, full_mask, pos, target)
        err = max(err, float((got - want).abs().max()))
        drift = max(drift, float((got - plain).abs().max()))
        tok = got.argmax(-1, keepdim=True)
        full_mask = torch.cat([full_mask, torch.ones_like(tok)], 1)
        pos = pos + 1
    assert err <= ROUNDING[torch.device(device).type]
    assert 4 * err < drift < BASE_DRIFT, (err, drift)

    # promotion: the TARGET bytes of every held token back, bit for bit
    assert cache.promote() == 2
    assert cache.fidelity.stats["base_blocks"] == 0 and cache.fidelity.stats["in_flight"] == 0
    assert cache.state.base_span.abs().sum() == 0
    assert cache.pager.free_pages == free
    for before, after in zip(held, _held(cache)):
        for (k0, v0), (k1, v1) in zip(before, after):
            n = k0.shape[0]
            assert torch.equal(k1[:n].view(torch.int16), k0.view(torch.int16))
            assert torch.equal(v1[:n].view(torch.int16), v0.view(torch.int16))


def test_demoted_blocks_decode_as_base_and_promotion_is_bit_exact():
    _demote_decode_promote(torch.device("cpu"))


def test_demotion_with_the_rounding_codec():
    _demote_decode_promote(torch.device("cpu"), codec="hi8r")


def test_demotion_through_the_kernels(kernel_device):
    """The same with the Triton kernels (pack, refine, elastic_attention's structured path;
    the interpreter on CPU, after a generate on the PyTorch path; CUDA on the GPU)."""
    cpu = kernel_device.type == "cpu"
    _demote_decode_promote(kernel_device, backend="triton" if cpu else None, steps=2 if cpu else 4)


def test_continuation_promotes_first_and_equals_sdpa():
    """A multi-token step onto a cache with BASE blocks promotes them (paged_prefill_attention
    reads TARGET): refinement is exact, so the continued conversation's tokens equal those of a
    cache that was never demoted. (Against SDPA over the whole text the float16 random model's
    near-ties flip tokens on some CPUs: the paged prefill and SDPA round differently.)"""
    model = _model16("llama")
    ids, mask = _prompts()
    fid = dict(min_batch=1)
    cache = kt.PagedCache(model, batch_size=2, max_tokens=96, page_size=S, fidelity=fid)
    plain = kt.PagedCache(model, batch_size=2, max_tokens=96, page_size=S, fidelity=fid)
    first = _generate(model, "kvops", ids, mask, cache)
    assert first.tolist() == _generate(model, "sdpa", ids, mask).tolist()
    assert _generate(model, "kvops", ids, mask, plain).tolist() == first.tolist()
    assert cache.demote(pages=2) == 2
    turn, _ = _prompts(T=6, pads=(0, 0), seed=5)
    full = torch.cat([ids, first, turn], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(first), torch.ones_like(turn)], dim=1)
    got = _generate(model, "kvops", full, full_mask, cache)
    assert cache.fidelity.stats["promoted"] == cache.fidelity.stats["demoted"]
    assert plain.fidelity.stats["demoted"] == 0
    assert got.tolist() == _generate(model, "kvops", full, full_mask, plain).tolist()
    cache.reset()          # ends every session, BASE or not: the pool is whole again
    assert cache.pager.free_pages == cache.pager.num_pages
    assert cache.fidelity.stats["base_blocks"] == 0


def test_budget_and_compiled_decode_reads_base_without_recompiling():
    """``demote(budget=...)`` brings the pages in use down; a compiled generate continues over
    the BASE blocks with its one graph (the span table is always passed), tokens equal the
    eager run's over the same demotion."""
    from transformers.generation.configuration_utils import CompileConfig

    from tests.test_transformers_integration import _counting_backend

    model = _model16("llama")
    ids, mask = _prompts()

    def run(compiled):
        graphs: list = []
        kw = {}
        if compiled:
            cc = CompileConfig(fullgraph=True, dynamic=False, backend=_counting_backend(graphs))
            cc._compile_all_devices = True
            kw["compile_config"] = cc
        cache = _fid_cache(model)
        out = _generate(model, "kvops", ids, mask, cache, max_new_tokens=24, **kw)
        in_use = cache.pager.num_pages - cache.pager.free_pages
        assert cache.demote(budget=in_use - 2) == 2
        assert cache.pager.num_pages - cache.pager.free_pages == in_use - 2
        more = _generate(model, "kvops", torch.cat([ids, out], 1),
                         torch.cat([mask, torch.ones_like(out)], 1), cache, max_new_tokens=8, **kw)
        assert cache.fidelity.stats["base_blocks"] == 4
        return more, len(graphs)

    torch._dynamo.reset()
    try:
        got, graphs = run(compiled=True)
    finally:
        torch._dynamo.reset()
    want, _ = run(compiled=False)
    assert graphs == 1
    assert got.tolist() == want.tolist()


def test_fidelity_errors():
    model = _model16("llama")
    with pytest.raises(ValueError, match="fidelity: BASE codecs need a float16 or bfloat16"):
        kt.PagedCache(_config("llama"), 2, 48, fidelity=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="fidelity: unknown option 'window'"):
        kt.PagedCache(model, 2, 48, fidelity=dict(window=4))
    with pytest.raises(ValueError, match="fidelity: expected None, True or a dict"):
        kt.PagedCache(model, 2, 48, fidelity="hi8")
    with pytest.raises(ValueError, match="codec: expected one of"):
        kt.PagedCache(model, 2, 48, fidelity=dict(codec="e4m3"))
    with pytest.raises(ValueError, match=r"\+ 1 = 7 .*got 6"):
        kt.PagedCache(model, 2, 48, page_size=16, num_pages=6, fidelity=True)
    plain = kt.PagedCache(model, 2, 48)
    with pytest.raises(ValueError, match="demote: this PagedCache has no fidelity policy"):
        plain.demote(pages=1)
    with pytest.raises(ValueError, match="promote: this PagedCache has no fidelity policy"):
        plain.promote()
    cache = _fid_cache(model)
    with pytest.raises(ValueError, match="demote: expected one of pages= and budget="):
        cache.demote()
    with pytest.raises(ValueError, match="pages: expected an int >= 1, got 0"):
        cache.demote(pages=0)
    with pytest.raises(ValueError, match="budget: expected an int >= 0"):
        cache.demote(budget=-1)
    assert cache.demote(pages=4) == 0            # nothing held yet: nothing to demote
    assert cache.promote() == 0
