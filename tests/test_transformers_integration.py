"""kvops inside transformers: ``attn_implementation="kvops"`` with SlidingCache and PagedCache
under ``model.generate``, against SDPA on the same weights (CPU, float32, tiny random configs of
every supported architecture, batch 2 with left padding), and compiled generation that compiles
once. Runs on the installed transformers (5.17-5.24)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf (or test) extra")

import kvops.integrations.transformers as kt  # noqa: E402
from kvops.integrations.transformers._compat import check_version  # noqa: E402
from tests.conftest import requires_cuda  # noqa: E402

NEW = 32
PAD = 0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(arch: str):
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=PAD)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common)
    if arch == "mistral-sw":   # a sliding window shorter than the context: kvops must honour it
        return transformers.MistralConfig(**common, sliding_window=24)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if arch == "smollm2":      # SmolLM2-135M's heads (Hq 9, Hkv 3, D 64: groups of 3), 2 layers
        return transformers.LlamaConfig(**{**common, "hidden_size": 576, "num_attention_heads": 9,
                                           "num_key_value_heads": 3}, tie_word_embeddings=True)
    raise ValueError(arch)


_MODELS: dict = {}


def _model(arch: str):
    if arch not in _MODELS:
        torch.manual_seed(0)
        cfg = _config(arch)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        _MODELS[arch] = model.eval()
    return _MODELS[arch]


def _prompts(B=2, T=11, vocab=160, pads=(0, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads[:B]):
        ids[b, :p], mask[b, :p] = PAD, 0
    return ids, mask


def _generate(model, impl, ids, mask, cache=None, **kw):
    model.set_attn_implementation(impl)
    kw.setdefault("max_new_tokens", NEW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # past_key_values -> cache on 5.24
        out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             do_sample=False, pad_token_id=PAD, **kw)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def sdpa_tokens():
    got = {}

    def tokens(arch, ids, mask):
        key = (arch, ids.numpy().tobytes(), mask.numpy().tobytes())
        if key not in got:
            got[key] = _generate(_model(arch), "sdpa", ids, mask)
        return got[key]
    return tokens


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "smollm2"]


def _cache(kind, model, B=2):
    if kind == "sliding":
        return kt.SlidingCache(model, batch_size=B, window=64)
    if kind == "sliding-far":
        return kt.SlidingCache(model, batch_size=B, window=32, far_chunks=4, far_chunk_size=4)
    return kt.PagedCache(model, batch_size=B, max_tokens=48, page_size=8)


def test_supported_versions():
    check_version()                       # the installed one
    for ok in ("5.17.0", "5.20.1", "5.24.0"):
        check_version(ok)
    for bad in ("4.57.1", "5.16.2", "5.25.0", "6.0.0"):
        with pytest.raises(ImportError, match="transformers >= 5.17, < 5.25"):
            check_version(bad)


@pytest.mark.parametrize("arch", ARCHS + ["mistral-sw"])
def test_sliding_cache_greedy_tokens_equal_sdpa(arch, sdpa_tokens):
    model = _model(arch)
    ids, mask = _prompts()
    cache = _cache("sliding", model)
    got = _generate(model, "kvops", ids, mask, cache)
    assert got.tolist() == sdpa_tokens(arch, ids, mask).tolist()
    # every decode step went through the cache: 11 prompt + 31 decode tokens
    assert all(int(layer.pos) == ids.shape[1] + NEW - 1 for layer in cache.layers)
    assert cache.layers[0].start.tolist() == [0, 4]


def test_sliding_cache_decode_reads_the_ring(sdpa_tokens):
    """Poisoning the slots of the padding (outside every window) changes nothing; poisoning a
    visible slot changes the tokens: the decode op reads the ring, and only the window."""
    model = _model("llama")
    ids, mask = _prompts()
    want = sdpa_tokens("llama", ids, mask)

    class Poison(kt.SlidingLayer):
        slot = None

        def _decode(self, query, key, value, scaling, sliding_window):
            self.keys[1, self.slot] = 1e4
            return super()._decode(query, key, value, scaling, sliding_window)

    def run(slot):
        cache = kt.SlidingCache(model, batch_size=2, window=64)
        for layer in cache.layers:
            layer.__class__ = Poison
            layer.slot = slot
        return _generate(model, "kvops", ids, mask, cache)

    assert run(slot=2).tolist() == want.tolist()     # row 1's padding: never visible
    assert run(slot=6)[1].tolist() != want[1].tolist()


def test_sliding_cache_wraps_past_the_window():
    """A window shorter than the context: each row attends to its last W tokens, the same as
    SDPA with a sliding-window mask of W (Mistral's sliding_window set to W)."""
    torch.manual_seed(0)
    cfg = _config("mistral")
    cfg.sliding_window = None
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids, mask = _prompts()
    cache = kt.SlidingCache(model, batch_size=2, window=16)
    got = _generate(model, "kvops", ids, mask, cache)
    model.config.sliding_window = 16
    try:
        want = _generate(model, "sdpa", ids, mask)
    finally:
        model.config.sliding_window = None
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_cache_greedy_tokens_equal_sdpa(arch, sdpa_tokens):
    model = _model(arch)
    ids, mask = _prompts()
    cache = _cache("paged", model)
    got = _generate(model, "kvops", ids, mask, cache)
    assert got.tolist() == sdpa_tokens(arch, ids, mask).tolist()
    # only real tokens are stored: 11 + 31 and 7 + 31; each row reserved 48 minus its padding
    assert all(layer.lens.tolist() == [42, 38] for layer in cache.layers)
    assert [len(cache.pager.pages(b)) for b in (0, 1)] == [6, 6]
    cache.reset()
    assert cache.pager.free_pages == cache.pager.num_pages and cache.pager.sessions() == []
    assert _generate(model, "kvops", ids, mask, cache).tolist() == got.tolist()


def test_paged_cache_continues_a_conversation(sdpa_tokens):
    """A second multi-token step onto a filled PagedCache (generate continuing from the cache:
    the last generated token and a new turn) gives the tokens SDPA gives for the whole text."""
    model = _model("qwen2")
    ids, mask = _prompts()
    cache = kt.PagedCache(model, batch_size=2, max_tokens=96, page_size=8)
    first = _generate(model, "kvops", ids, mask, cache)
    assert first.tolist() == sdpa_tokens("qwen2", ids, mask).tolist()
    turn, _ = _prompts(T=6, pads=(0, 0), seed=5)
    full = torch.cat([ids, first, turn], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(first), torch.ones_like(turn)], dim=1)
    got = _generate(model, "kvops", full, full_mask, cache)      # 1 + 6 new tokens, then decode
    want = _generate(model, "sdpa", full, full_mask)
    assert got.tolist() == want.tolist()
    assert cache.layers[0].lens.tolist() == [11 + 32 + 6 + 31, 7 + 32 + 6 + 31]


def test_paged_cache_stores_only_real_tokens():
    """The pool holds each row's real tokens at logical slots 0.. of its pages and nothing else
    (padding never written), which is what elastic_attention reads."""
    model = _model("llama")
    ids, mask = _prompts()
    cache = _cache("paged", model)
    model.set_attn_implementation("kvops")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids, attention_mask=mask, past_key_values=cache)   # the prompt step only
    pool = cache.layers[0].keys.reshape(-1, *cache.layers[0].keys.shape[2:])
    written = torch.zeros(pool.shape[0], dtype=torch.bool)
    for b, n in ((0, 11), (1, 7)):
        pages = cache.pager.pages(b)
        slots = [pages[i // 8] * 8 + i % 8 for i in range(n)]
        assert pool[slots].abs().sum(-1).gt(0).all()
        written[slots] = True
    assert pool[~written].abs().sum() == 0            # padding and the future: not written
    assert cache.layers[0].lens.tolist() == [11, 7]


def _layer0_keys(model, ids, mask):
    """Layer 0's RoPE'd keys [B, T, Hkv, D] of a plain forward (they depend on the tokens and
    positions only, so they are the keys any cache saw for these tokens)."""
    model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    return cache.layers[0].keys.transpose(1, 2)


def test_sliding_cache_far_view():
    """far_chunks=C: the last C chunks of tokens that left the ring, as means weighted by their
    count, in the prompt step (T > W) and after decode steps; padding never counted; with the
    window holding the context the far slots are empty and the tokens are SDPA's."""
    model = _model("llama")
    ids, mask = _prompts()
    want = _generate(model, "sdpa", ids, mask)
    full = kt.SlidingCache(model, batch_size=2, window=64, far_chunks=4, far_chunk_size=4)
    assert _generate(model, "kvops", ids, mask, full).tolist() == want.tolist()
    assert full.state.far_bias.isinf().all()

    def expect(keys, layer, groups, C=2, size=4):
        for g in groups:
            for b, pad in ((0, 0), (1, 4)):
                rows = [p for p in range(g * size, (g + 1) * size) if pad <= p < groups[g]]
                c = g % C
                got_count = float(layer.state.far_count[b, c])
                assert got_count == len(rows), (b, g)
                if rows:
                    torch.testing.assert_close(layer.far_k[b, c], keys[b, rows].mean(0))
                else:
                    assert layer.state.far_bias[b, c] == float("-inf")

    # the prompt step alone, W 4 < T 11: positions 0..6 left the ring: chunks 0 (0-3), 1 (4-6)
    cache = kt.SlidingCache(model, batch_size=2, window=4, far_chunks=2, far_chunk_size=4)
    model.set_attn_implementation("kvops")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              past_key_values=cache)
    expect(_layer0_keys(model, ids, mask), cache.layers[0], {0: 7, 1: 7})

    # 32 generated tokens through W 16: 42 positions written, 0..25 left; the last 2 chunks
    # are 5 (20-23) and 6 (24-25)
    cache = kt.SlidingCache(model, batch_size=2, window=16, far_chunks=2, far_chunk_size=4)
    got = _generate(model, "kvops", ids, mask, cache)
    seq = torch.cat([ids, got[:, :-1]], dim=1)
    seq_mask = torch.cat([mask, torch.ones_like(got[:, :-1])], dim=1)
    expect(_layer0_keys(model, seq, seq_mask), cache.layers[0], {5: 26, 6: 26})


def _counting_backend(graphs):
    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("kind,how", [
    ("sliding-far", "compile_config"), ("paged", "compile_config"),
    # the whole forward compiled: prompt graphs too (20-50 s on 2 cores), so with -m slow
    pytest.param("sliding", "torch.compile(forward)", marks=pytest.mark.slow),
    pytest.param("paged", "torch.compile(forward)", marks=pytest.mark.slow)])
def test_compiled_generation_compiles_once(kind, how, sdpa_tokens):
    from transformers.generation.configuration_utils import CompileConfig

    torch._dynamo.reset()
    model = _model("llama")
    ids, mask = _prompts()
    graphs: list = []
    backend = _counting_backend(graphs)
    kw = {}
    if how == "compile_config":
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
        cc._compile_all_devices = True          # compile on CPU too
        kw["compile_config"] = cc
    else:
        eager_forward = model.forward
        # the paged prompt step breaks its graph at the pager's frame (host work); decode is one
        model.forward = torch.compile(model.forward, backend=backend, dynamic=False,
                                      fullgraph=kind != "paged")
    try:
        cache = _cache(kind, model)
        got = _generate(model, "kvops", ids, mask, cache, **kw)
        warm = len(graphs)
        cache.reset()
        again = _generate(model, "kvops", ids, mask, cache, **kw)
    finally:
        if how != "compile_config":
            model.forward = eager_forward
        torch._dynamo.reset()
    if kind == "sliding-far":        # the ring (32) wraps at 43 tokens: compare with eager
        want = _generate(model, "kvops", ids, mask, _cache(kind, model))
    else:
        want = sdpa_tokens("llama", ids, mask)
    assert got.tolist() == want.tolist() and again.tolist() == want.tolist()
    # the decode step compiles once (plus the prompt's graphs, when the whole forward is compiled)
    if how == "compile_config":
        assert warm == 1
    assert len(graphs) == warm, "recompiled after warm-up"


def test_errors():
    model = _model("llama")
    with pytest.raises(ValueError, match="window: expected an int >= 1"):
        kt.SlidingCache(model, batch_size=2, window=0)
    with pytest.raises(ValueError, match="batch_size"):
        kt.SlidingCache(model, batch_size=0, window=8)
    with pytest.raises(TypeError, match="model_or_config"):
        kt.SlidingCache(object(), batch_size=1, window=8)
    ids, mask = _prompts()
    # batch of the cache and of the prompts differ
    with pytest.raises(ValueError, match=r"key_states: expected shape \[B=3"):
        _generate(model, "kvops", ids, mask, kt.SlidingCache(model, batch_size=3, window=64))
    # a kvops cache under another attention implementation
    with pytest.raises(TypeError, match='attn_implementation="kvops"'):
        _generate(model, "sdpa", ids, mask, kt.SlidingCache(model, batch_size=2, window=64))
    cache = kt.SlidingCache(model, batch_size=2, window=64)
    model.set_attn_implementation("kvops")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids, attention_mask=mask, past_key_values=cache)
        with pytest.raises(NotImplementedError, match="reset"):   # a second prompt
            model(ids, attention_mask=mask, past_key_values=cache)
        paged = kt.PagedCache(model, batch_size=2, max_tokens=16, page_size=8)
        model(ids, attention_mask=mask, past_key_values=paged)
        with pytest.raises(ValueError, match="exceed max_tokens=16"):
            model(ids, attention_mask=mask, past_key_values=paged)
        with pytest.raises(ValueError, match="exceeds max_tokens=8"):
            model(ids, attention_mask=mask,
                  past_key_values=kt.PagedCache(model, batch_size=2, max_tokens=8, page_size=8))
    with pytest.raises(ValueError, match=r"page_size\) = 4 .*got 3"):
        kt.PagedCache(model, batch_size=2, max_tokens=16, page_size=8, num_pages=3)


@pytest.mark.parametrize("kind", ["sliding", "paged"])
def test_kernels_inside_generate(kind, kernel_device):
    """The Triton kernels (CUDA, or the interpreter on CPU) under generate: the same greedy
    tokens as SDPA on the same device."""
    import kvops

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config("llama"), attn_implementation="sdpa").eval().to(kernel_device)
    ids, mask = (t.to(kernel_device) for t in _prompts())
    kw = dict(max_new_tokens=3) if kernel_device.type == "cpu" else {}   # interpreter: slow
    want = _generate(model, "sdpa", ids, mask, **kw)
    with kvops.backend("triton" if kernel_device.type == "cpu" else "auto"):
        got = _generate(model, "kvops", ids, mask, _cache(kind, model), **kw)
    assert got.tolist() == want.tolist()


@requires_cuda
@pytest.mark.parametrize("kind", ["sliding", "paged"])
def test_cuda_generate_compiles_once_with_cuda_graphs(kind):
    """transformers' own compiled generation on CUDA (inductor, reduce-overhead: CUDA graphs):
    one compile for the decode step, none after warm-up, tokens equal SDPA's (float32)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config("llama"), attn_implementation="sdpa").eval().cuda()
    ids, mask = (t.cuda() for t in _prompts())
    want = _generate(model, "sdpa", ids, mask, disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    cache = _cache(kind, model)
    got = _generate(model, "kvops", ids, mask, cache)
    warm = counters["stats"]["unique_graphs"]
    cache.reset()
    again = _generate(model, "kvops", ids, mask, cache)
    assert counters["stats"]["unique_graphs"] == warm == 1
    assert got.tolist() == want.tolist() and again.tolist() == want.tolist()
    torch._dynamo.reset()


def test_kvops_attention_without_kvops_cache_is_sdpa(sdpa_tokens):
    model = _model("qwen2")
    ids, mask = _prompts()
    assert _generate(model, "kvops", ids, mask).tolist() == sdpa_tokens("qwen2", ids, mask).tolist()


@pytest.mark.slow
def test_smollm2_from_gguf_greedy_tokens_equal_sdpa():
    """The trained SmolLM2-135M-Instruct loaded by transformers from its GGUF with
    attn_implementation="kvops": two chat prompts of different lengths (left-padded), 32 greedy
    tokens through both caches equal SDPA's, and the answer is right. About 40 s on 2 cores
    (mostly dequantizing the file), hence -m slow."""
    pytest.importorskip("gguf", reason="the 'model' extra is not installed")
    from kvops.models import ModelUnavailable, Tokenizer
    from kvops.models.gguf import gguf_path

    try:
        path = gguf_path()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="kvops").eval()
    tok = Tokenizer.from_gguf(path)
    prompts = [tok.encode(tok.chat_prompt(q)) for q in
               ("What is the capital of France?", "Name a primary colour.")]
    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    want = _generate(model, "sdpa", ids, mask)
    for cache in (kt.SlidingCache(model, 2, window=T + NEW),
                  kt.PagedCache(model, 2, max_tokens=T + NEW)):
        assert _generate(model, "kvops", ids, mask, cache).tolist() == want.tolist()
    assert "Paris" in tok.decode(want[0].tolist())


def test_paged_cache_pools_share_no_storage():
    """Every layer's K and V pool is an allocation of its own: a compiled decode step whose
    mutated inputs alias is rebuilt by AOTAutograd from a synthetic base (an as_strided clone
    of the whole allocation each step), which read out of bounds under inductor on CUDA."""
    model = _model("llama")
    for fidelity in (None, True):
        cache = kt.PagedCache(model, batch_size=2, max_tokens=48, page_size=8, fidelity=fidelity,
                              dtype=torch.float16)
        pools = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        assert len(pools) == 2 * model.config.num_hidden_layers
        assert len({p.untyped_storage().data_ptr() for p in pools}) == len(pools)
