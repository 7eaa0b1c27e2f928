"""The far view's quality on a real model: its attention for every position, perplexity and
retrieval's selection churn on SmolLM2-135M.

Configurations (near window ``WINDOW = 512`` tokens, ``PAGE = 16``-token pages, far chunks of
``CHUNK = 128`` tokens), named as :func:`parse_config` reads them:

- ``dense``: the model's causal forward (SDPA over every earlier token);
- ``near``: each token attends to its window alone, the transport's window (the last W / S
  pages: from the first window page's first token to itself);
- ``far<cap>`` / ``far<cap>-nobias``: the window plus up to ``cap`` far-chunk summaries with
  ``far_bias = log(128)`` / ``0``;
- ``ret<K>`` / ``ret<K>-every<N>``: the retrieval far view, the window plus the exact tokens of
  the ``K`` far pages ``torch.ops.kvops.far_page_select`` chooses for each query (on
  ``torch.ops.kvops.far_page_summarize`` bounds: half by the best key bound over the heads,
  half by the bounds summed over them), bias 0; ``-every<N>`` chooses
  with the query of every ``N``-th position (:func:`retrieval_every`); ``@<S>`` (e.g.
  ``ret128@8``) runs it on pages of ``S`` tokens instead of ``PAGE`` (:func:`retrieval_page`:
  the window, the bounds and the selection all at that page size, as a pager of ``S``-token
  pages serves it);
- ``reth<K>[@<S>]`` (diagnostic, not a kvops path: ``far_page_select`` keeps one page list a
  sequence): the retrieval far view with a page list per KV head, the ``K`` pages of best
  bound for that head's query group (:func:`head_pages`);
- ``sink<n>``, ``<config>+sink<n>`` and ``ret<K>+sink<n>[@<S>]`` (diagnostics, not a kvops
  path): the window (and far
  view) plus the sequence's first ``n`` tokens exact (StreamingLLM's attention sink);
- ``ret<K>+dense<n>[@<S>]`` (diagnostic): the retrieval far view in every layer but the first
  ``n``, which attend densely (:func:`dense_layers`; Quest leaves its first two layers dense).
- ``ret<K>+rest[@<S>]`` (diagnostic, not a kvops path): the retrieval far view plus, for each
  far page it does not choose, that page's mean key and value with the bias ``log(S)``
  (:func:`retrieval_rest`): the far attention mass the chosen pages leave out, estimated.
- ``ret<K>[-every<N>]+decode[@<S>]``: the retrieval far view as a serving engine runs it
  (:func:`decode_only`, :func:`hidden_states_served`): the prompt prefilled with dense causal
  attention (the engine's ``paged_prefill_attention`` reads the whole paged prefix), its far
  pages summarized at once (``FarRetrieval.begin_step(drain=True)``), and the answer's
  positions decoded with the far view, the first decode step selecting (with ``-every<N>``
  every ``N``-th from it); ``near+decode``, its control, decodes the answer over the window
  alone. Every other config applies its attention at every position, as if the prompt were
  decoded token by token too.

Block-parallel evaluation (:func:`attention_banded`, :func:`hidden_states`,
:func:`perplexity`): every query position gets the attention a decode step with
:class:`kvops.runtime.FarView` (or :class:`kvops.runtime.FarRetrieval`) gives it (its window
plus the ``torch.ops.kvops.far_view_summarize`` means of every complete chunk before the window,
or its chosen far pages; keys after RoPE as the pool holds them), computed for a block of
queries at once with one masked SDPA over the contiguous key band plus the summaries.
:func:`check_paths` compares it with the same attention through
``torch.ops.kvops.static_sliding_attention`` (:func:`attention_far`). A ``far`` config is exact
when every far chunk fits the cap (at SmolLM2's 8192 positions, at most 60 chunks); a smaller
cap is refused. :func:`sequential_nll` decodes token by token through ``Pager`` + ``FarView``
instead (any cap: the EMA-utility ranking then chooses). :func:`selection_churn` measures how
fast the retrieval choice moves from one position to the next.

The retrieval tasks (passkey, multikey) over these configurations live in
:mod:`kvops.evals.passkey`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvops.evals.perplexity import hidden_states_with, nll_sum
from kvops.models import Llama
from kvops.ops.far_page_select import head_bounds_ref, page_scores_ref

WINDOW, PAGE, CHUNK = 512, 16, 128


SERVED = "+decode"


def _unserved(name: str) -> tuple[str, bool]:
    """``<config>+decode[@<S>]`` -> (``<config>[@<S>]``, True); any other name -> (name,
    False)."""
    head, at, size = name.partition("@")
    if head.endswith(SERVED):
        return head[: -len(SERVED)] + at + size, True
    return name, False


def parse_config(name: str) -> tuple[str, int, bool, int]:
    """``"dense" | "near" | "far<cap>[-nobias]"``, optionally ``+sink<n>`` (``"sink<n>"`` alone
    is ``near+sink<n>``), or ``"ret<K>[-every<N>][+sink<n>][@<S>]"`` -> (mode, cap,
    log_count_bias, sink tokens); ``near`` and ``ret`` configs may end in ``+decode``
    (:func:`decode_only`)."""
    plain, served = _unserved(name)
    parsed = _parse_config(plain)
    if served and parsed[0] not in ("near", "ret"):
        raise ValueError(f"config: expected +decode after near or ret<K> (FarRetrieval drains a "
                         f"prefill's far pages; nothing else here does), got {name!r}")
    return parsed


def _parse_config(name: str) -> tuple[str, int, bool, int]:
    if name.startswith("ret"):
        retrieval_page(name)                  # a bad page size is refused here
        name = name.partition("@")[0]
        head, plus, extra = name.partition("+")
        if extra.startswith("dense") and extra[5:].isdigit() or extra == "rest":
            name = head                       # dense layers, rest: dense_layers and
                                              # retrieval_rest read them
    base, plus, extra = name.partition("+")
    sink = int(extra[4:]) if extra.startswith("sink") and extra[4:].isdigit() else -1
    if base.startswith("sink") and base[4:].isdigit() and not plus:
        return "near", 0, False, int(base[4:])
    if plus and sink < 0 or base == "dense" and plus:
        raise ValueError(f"config: expected +sink<n> after near or far<cap>, got {name!r}")
    sink = max(sink, 0)
    if base in ("dense", "near"):
        return base, 0, False, sink
    if base.startswith("reth") and base[4:].isdigit() and int(base[4:]) > 0 and not plus:
        return "reth", int(base[4:]), False, 0
    if base.startswith("ret"):
        top, _, suffix = base[3:].partition("-")
        if top.isdigit() and int(top) > 0 and (suffix == "" or suffix.startswith("every")
                                               and suffix[5:].isdigit() and int(suffix[5:]) > 0):
            return "ret", int(top), False, sink
    if base.startswith("far"):
        cap, _, suffix = base[3:].partition("-")
        if cap.isdigit() and suffix in ("", "nobias"):
            return "far", int(cap), suffix == "", sink
    raise ValueError(f"config: expected dense, near, sink<n>, far<cap> or far<cap>-nobias "
                     f"(+sink<n>), ret<K> or ret<K>-every<N>, got {name!r}")


def dense_layers(name: str) -> int:
    """``ret<K>+dense<n>[@<S>]`` -> n, the first layers that attend densely; 0 otherwise."""
    extra = name.partition("@")[0].partition("+")[2]
    tail = extra[5:]
    return int(tail) if name.startswith("ret") and extra.startswith("dense") and tail.isdigit() else 0


def retrieval_rest(name: str) -> bool:
    """``ret<K>+rest[@<S>]`` -> True: the unchosen far pages join as page means."""
    return name.startswith("ret") and name.partition("@")[0].partition("+")[2] == "rest"


def decode_only(name: str) -> bool:
    """``<config>+decode[@<S>]`` (``ret`` or ``near``) -> True: the far view (or the window
    alone) at the answer's (decode) positions only, the prompt prefilled densely
    (:func:`hidden_states_served`)."""
    return _unserved(name)[1]


def retrieval_every(name: str) -> int:
    """``ret<K>-every<N>`` -> N (selection every N positions); 1 for any other config."""
    _, _, suffix = name.partition("@")[0].partition("+")[0].partition("-every")
    return int(suffix) if name.startswith("ret") and suffix else 1


def retrieval_page(name: str) -> int:
    """``ret<K>...@<S>`` -> S, the page size the retrieval far view runs on (a power of two of
    at least 8 that divides ``WINDOW``); ``PAGE`` for any other config."""
    head, at, size = name.partition("@")
    if not at:
        return PAGE
    S = int(size) if size.isdigit() else 0
    if not head.startswith("ret") or S < 8 or S & (S - 1) or WINDOW % S:
        raise ValueError(f"config: expected ret<K>@<S> with S a power of two >= 8 dividing the "
                         f"window ({WINDOW}), got {name!r}")
    return S


def page_bounds(k, page: int | None = None):
    """Per-channel key min and max of every complete page of ``page`` tokens (default
    ``PAGE``) of ``k [T, Hkv, D]`` through ``torch.ops.kvops.far_page_summarize``: ``[1,
    T // page, Hkv, D]`` each."""
    page = page or PAGE
    T, Hkv, D = k.shape
    n = T // page
    pages = torch.arange(n, dtype=torch.int32, device=k.device).view(1, n)
    return torch.ops.kvops.far_page_summarize(k[: n * page].contiguous().view(n, page, Hkv, D),
                                              pages)


def retrieval_pages(q, bounds, t, n_pages, top_k: int, every: int = 1, anchor: int = 0):
    """Far pages each query position ``t`` attends to under the retrieval far view: the
    ``top_k`` pages ``torch.ops.kvops.far_page_select`` chooses by key bound among its
    far pages ``[0, n_pages[t])``, chosen with the query of position ``t - (t - anchor) %
    every`` (and its far pages: selection every ``every`` steps from position ``anchor``).
    ``q`` holds the queries of positions ``t`` (those selecting positions must be among them).
    Returns a bool mask ``[len(t), pages]``."""
    lo, hi = bounds
    N = lo.shape[1]
    at = t - (t - anchor) % every
    row = torch.searchsorted(t, at)
    qs, nf = q[row], n_pages[at].to(torch.int32)
    idx, _ = torch.ops.kvops.far_page_select(qs, lo.expand(len(t), -1, -1, -1),
                                             hi.expand(len(t), -1, -1, -1), nf, min(top_k, N))
    sel = torch.zeros(len(t), N + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(1, torch.where(idx >= 0, idx, N).long(), True)
    return sel[:, :N]


def head_pages(q, bounds, n_pages, top_k: int):
    """Per KV head, the ``top_k`` far pages of best key bound for that head's query group
    (the ``reth`` diagnostic): q [n, Hq, D], bounds ``([1, N, Hkv, D], [1, N, Hkv, D])``,
    n_pages [n] far pages of each query -> bool ``[Hkv, n, N]``."""
    lo, hi = bounds
    N, Hkv = lo.shape[1], lo.shape[2]
    n = q.shape[0]
    bound = head_bounds_ref(q, lo.expand(n, -1, -1, -1), hi.expand(n, -1, -1, -1)).amax(dim=2)
    cand = torch.arange(N, device=q.device)[None, None, :] < n_pages.long()[:, None, None]
    bound = torch.where(cand, bound, float("-inf"))
    val, idx = torch.topk(bound, min(top_k, N), dim=2)                    # [n, Hkv, K]
    sel = torch.zeros(n, Hkv, N + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(2, torch.where(val > float("-inf"), idx, N), True)
    return sel[..., :N].permute(1, 0, 2)


def window_geometry(T: int, device, page: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """Per query position t: (win_start, win_len) into the W keys ending at t (the window is
    the last ``W / page`` pages of ``page`` tokens, default ``PAGE``), and the number of
    complete far chunks before its window."""
    page = page or PAGE
    t = torch.arange(T, device=device)
    blocks = (t + 1 + page - 1) // page
    first = (blocks - WINDOW // page).clamp(min=0) * page         # first window token
    win_start = (first - t + WINDOW - 1).to(torch.int32)
    win_len = (t - first + 1).to(torch.int32)
    return win_start, win_len, first // CHUNK


def far_pages(T: int, device, page: int | None = None) -> torch.Tensor:
    """Per query position, the complete pages of ``page`` tokens (default ``PAGE``) before its
    window: the far pages it can choose from."""
    page = page or PAGE
    _, win_len, _ = window_geometry(T, device, page)
    return (torch.arange(T, device=device) - win_len + 1) // page


@torch.no_grad()
def attention_far(q, k, v, mode: str, cap: int, bias: bool, q_block: int = 256, every: int = 1,
                  page: int | None = None):
    """One layer's attention for every position: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]
    (``page``: the retrieval far view's page size, default ``PAGE``)."""
    page = page or PAGE
    T, Hkv, D = k.shape
    win_start, win_len, n_far = window_geometry(T, q.device, page)
    pad = q.new_zeros(WINDOW, Hkv, D)
    kp, vp = torch.cat([pad, k]), torch.cat([pad, v])
    far = None
    if mode == "ret":
        bounds = page_bounds(k, page)
        n_pages = far_pages(T, q.device, page)
        N = bounds[0].shape[1]
        kpg = k[: N * page].reshape(N, page, Hkv, D)
        vpg = v[: N * page].reshape(N, page, Hkv, D)
    if mode == "far" and T >= CHUNK:
        far = (*far_summaries(k, v), math.log(CHUNK) if bias else 0.0)
    out = torch.empty_like(q)
    row = Hkv * D
    for t0 in range(0, T, q_block):
        n = min(q_block, T - t0)
        kw = kp.as_strided((n, WINDOW, Hkv, D), (row, row, D, 1), (t0 + 1) * row)
        vw = vp.as_strided((n, WINDOW, Hkv, D), (row, row, D, 1), (t0 + 1) * row)
        ws, wl = win_start[t0:t0 + n], win_len[t0:t0 + n]
        args = ()
        if mode == "ret" and N:
            t = torch.arange(t0 - t0 % every, t0 + n, device=q.device)
            sel = retrieval_pages(q[t], bounds, t, n_pages, cap, every)[-n:]     # [n, N]
            K = min(cap, N)
            idx = torch.where(sel, torch.arange(N, device=q.device), N).sort(dim=1).values[:, :K]
            live = idx < N
            rows = idx.clamp(max=N - 1).flatten()
            fk = kpg[rows].view(n, K * page, Hkv, D)
            fv = vpg[rows].view(n, K * page, Hkv, D)
            fb = torch.where(live, 0.0, float("-inf")).repeat_interleave(page, dim=1)
            args = (fk, fv, fb.to(torch.float32))
        elif mode == "far":
            slot = torch.arange(cap, device=q.device)
            live = slot[None, :] < n_far[t0:t0 + n, None]                 # [n, cap]
            if far is None:
                fk = q.new_zeros(n, cap, Hkv, D)
                fv = fk
            else:
                idx = slot.clamp(max=far[0].shape[0] - 1)
                fk = far[0][idx].expand(n, -1, -1, -1)
                fv = far[1][idx].expand(n, -1, -1, -1)
            fb = torch.where(live, far[2] if far else 0.0, float("-inf")).to(torch.float32)
            args = (fk, fv, fb)
        out[t0:t0 + n], _ = torch.ops.kvops.static_sliding_attention(q[t0:t0 + n], kw, vw, ws, wl, *args)
    return out


def far_summaries(k, v):
    """Every complete chunk's mean K and V ([chunks, Hkv, D] each) through the kvops op."""
    T, Hkv, D = k.shape
    chunks, M = T // CHUNK, CHUNK // PAGE
    # the model's v is a view of its fused projection, rows not dense: the op takes pages
    # whose [S, Hkv, D] rows are
    pages = (t[: chunks * CHUNK].contiguous().view(chunks * M, PAGE, Hkv, D) for t in (k, v))
    table_ = torch.arange(chunks * M, dtype=torch.int32, device=k.device).view(1, chunks, M)
    k_sum, v_sum = torch.ops.kvops.far_view_summarize(*pages, table_)
    return k_sum[0], v_sum[0]


@torch.no_grad()
def attention_banded(q, k, v, mode: str, cap: int, bias: bool, sink: int = 0, q_block: int = 256,
                     q0: int = 0, every: int = 1, page: int | None = None, rest: bool = False,
                     anchor: int = 0):
    """The same attention as :func:`attention_far` in one SDPA call per block of queries: the
    block's keys are the contiguous band ``[t0 - W, t0 + n)`` (no per-query copies) plus the
    far summaries, with a mask (window bounds, far chunk counts) carrying the far bias. This is
    what the evaluation runs; :func:`check_paths` compares it with the kvops-op path at start.
    ``sink`` (diagnostic) adds the first ``sink`` tokens exact where the window lacks them.
    ``mode="dense"``: causal attention over every earlier key. ``q0``: ``q`` holds only the
    queries of positions ``[q0, T)`` (``k, v`` all ``T``); the output is theirs.
    ``mode="ret"``: the window plus the exact tokens of the ``cap`` far pages
    :func:`retrieval_pages` picks for each query (bias 0); with ``every > 1`` the selecting
    positions are ``anchor, anchor + every, ...`` and ``q0 - anchor`` must be a multiple of
    ``every``; ``page``: its page size (the window's too; default ``PAGE``);
    ``rest``: each far page it does not choose joins as its mean key and value, bias
    ``log(page)``."""
    page = page or PAGE
    T = k.shape[0]
    win_start, win_len, n_far = window_geometry(T, q.device, page)
    first = torch.arange(T, device=q.device) - win_len + 1                  # first visible key
    if mode == "dense":
        first = torch.zeros_like(first)
    if mode == "far" and int(n_far.max()) > cap:
        raise ValueError(f"far{cap}: {int(n_far.max())} far chunks at T={T} exceed the cap; "
                         f"the block-parallel evaluation needs every chunk to fit")
    far = far_summaries(k, v) if mode == "far" and T >= CHUNK else None
    if mode in ("ret", "reth"):
        if (q0 - anchor) % every:
            raise ValueError(f"attention_banded: q0={q0} is not anchor={anchor} plus a "
                             f"multiple of every={every}")
        bounds = page_bounds(k, page)
        n_pages = first // page
        q_block = max(every, q_block - q_block % every)
        if rest:
            n_all = bounds[0].shape[1]
            k_mean = k[: n_all * page].unflatten(0, (n_all, page)).mean(dim=1)
            v_mean = v[: n_all * page].unflatten(0, (n_all, page)).mean(dim=1)
    out = torch.empty_like(q)
    for t0 in range(q0, T, q_block):
        n = min(q_block, T - t0)
        lo = 0 if mode in ("dense", "ret", "reth") else max(0, t0 - WINDOW)
        keys = torch.arange(lo, t0 + n, device=q.device)
        t = torch.arange(t0, t0 + n, device=q.device)
        mask = (keys[None, :] >= first[t, None]) & (keys[None, :] <= t[:, None])
        if mode == "ret" and bounds[0].shape[1]:
            sel = retrieval_pages(q[t0 - q0:t0 - q0 + n], bounds, t, n_pages, cap, every,
                                  anchor)
            tok = sel.repeat_interleave(page, dim=1)                     # [n, pages * page]
            mask[:, : tok.shape[1]] |= tok[:, : mask.shape[1]]
        if mode == "reth" and bounds[0].shape[1]:
            sel = head_pages(q[t0 - q0:t0 - q0 + n], bounds, n_pages[t], cap)  # [Hkv, n, N]
            tok = sel.repeat_interleave(page, dim=2)[..., : mask.shape[1]]
            mask = mask[None].repeat(sel.shape[0], 1, 1)
            mask[..., : tok.shape[2]] |= tok
            mask = mask.repeat_interleave(q.shape[1] // sel.shape[0], dim=0)     # [Hq, n, keys]
        if sink and mode == "ret":          # keys start at 0: the first tokens join the mask
            mask[:, :sink] |= keys[None, :sink] <= t[:, None]
        bias_ = torch.where(mask, 0.0, float("-inf"))
        kb, vb = k[lo:t0 + n], v[lo:t0 + n]
        if sink and mode != "ret":          # the first `sink` tokens, where not in the window
            head = torch.arange(min(sink, T), device=q.device)
            seen = (head[None, :] < first[t, None]) & (head[None, :] <= t[:, None])
            bias_ = torch.cat([torch.where(seen, 0.0, float("-inf")), bias_], dim=1)
            kb, vb = torch.cat([k[head], kb]), torch.cat([v[head], vb])
        if rest and mode == "ret" and bounds[0].shape[1]:     # the far pages not chosen
            left = ~sel & (torch.arange(sel.shape[1], device=q.device)[None, :]
                           < n_pages[t, None])
            bias_ = torch.cat([bias_, torch.where(left, math.log(page), float("-inf"))], dim=1)
            kb, vb = torch.cat([kb, k_mean]), torch.cat([vb, v_mean])
        if far is not None:
            c = torch.arange(far[0].shape[0], device=q.device)
            live = c[None, :] < n_far[t, None]
            fb = torch.where(live, math.log(CHUNK) if bias else 0.0, float("-inf"))
            bias_ = torch.cat([bias_, fb], dim=1)
            kb, vb = torch.cat([kb, far[0]]), torch.cat([vb, far[1]])
        o = F.scaled_dot_product_attention(q[t0 - q0:t0 - q0 + n].transpose(0, 1),
                                           kb.transpose(0, 1), vb.transpose(0, 1),
                                           attn_mask=bias_.to(q.dtype), enable_gqa=True)
        out[t0 - q0:t0 - q0 + n] = o.transpose(0, 1)
    return out


@torch.no_grad()
def attention_dense(q, k, v, q0: int = 0):
    """Causal attention of the queries of positions ``[q0, T)`` (``q [T - q0, Hq, D]``) over
    ``k, v [T, Hkv, D]``: the keys before ``q0`` unmasked and the keys from ``q0`` causal, two
    calls of PyTorch's CPU flash kernel merged by their log-sum-exp. The same attention as
    ``attention_banded(..., "dense", q0=q0)``, several times faster on the CPU (a masked SDPA
    materializes every score). On CUDA it is the banded path's dense mode."""
    if q.device.type != "cpu":
        return attention_banded(q, k, v, "dense", 0, False, q0=q0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh, vh = (t.repeat_interleave(g, 1).transpose(0, 1)[None] for t in (k, v))
    o, lse = flash(qh, kh[:, :, q0:], vh[:, :, q0:], 0.0, True)[:2]
    if q0:
        o_pre, lse_pre = flash(qh, kh[:, :, :q0], vh[:, :, :q0], 0.0, False)[:2]
        lse_all = torch.logaddexp(lse, lse_pre)
        o = o * (lse - lse_all).exp()[..., None] + o_pre * (lse_pre - lse_all).exp()[..., None]
    return o[0].transpose(0, 1)


def check_paths(model: Llama, ids: torch.Tensor, configs: list[str]) -> float:
    """Largest difference between the banded and the kvops-op attention on layer 0 of ``ids``,
    over the configurations' window and far parts (a ``+sink`` diagnostic is checked without
    its sink tokens, which have no kvops path)."""
    T = ids.shape[0]
    x = model.layers[0].attention_norm(model.tok_embeddings(ids))
    q, k, v = model.layers[0].attention._qkv(x, model.rope_cos[:T], model.rope_sin[:T])
    worst = 0.0
    chunks = int(window_geometry(T, ids.device)[2].max())
    for c in configs:
        mode, cap, bias, _ = parse_config(c)
        if mode in ("dense", "reth"):     # reth: a diagnostic with no kvops path
            continue
        every, page = retrieval_every(c), retrieval_page(c)
        if mode == "ret":                 # fewer pages than are far, so the selection binds
            cap = min(cap, 8)
        else:
            cap = max(cap, chunks)        # a --sequential cap may be smaller; check the paths
        a = attention_banded(q, k, v, mode, cap, bias, every=every, page=page)
        b = attention_far(q, k, v, mode, cap, bias, q_block=64, every=every, page=page)
        worst = max(worst, (a - b).abs().max().item())
    return worst


@torch.no_grad()
def hidden_states(model: Llama, ids: torch.Tensor, config: str) -> torch.Tensor:
    """Final-norm hidden states [T, dim] of ``ids [T]`` under one configuration."""
    mode, cap, bias, sink = parse_config(config)
    if decode_only(config):
        raise ValueError(f"config: {config!r} decodes after a prompt; every position of a text "
                         f"is not a decode step (hidden_states_served takes the prompt length)")
    if mode == "dense":
        return model.hidden_states(ids[None])[0]
    T = ids.shape[0]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_embeddings(ids)
    dense_below = dense_layers(config)
    for layer, block in enumerate(model.layers):
        att = block.attention
        q, k, v = att._qkv(block.attention_norm(x), cos, sin)
        if layer < dense_below:
            o = attention_dense(q, k, v, 0)
        else:
            o = attention_banded(q, k, v, mode, cap, bias, sink, every=retrieval_every(config),
                                 page=retrieval_page(config), rest=retrieval_rest(config))
        x = x + att.wo(o.flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x)


@torch.no_grad()
def hidden_states_from(model: Llama, ids: torch.Tensor, config: str, start: int = 0,
                       cache: list | None = None) -> tuple[torch.Tensor, list]:
    """Final-norm hidden states ``[T - start, dim]`` of positions ``[start, T)`` of ``ids [T]``
    under one configuration (``dense`` through :func:`attention_dense`), and every layer's
    ``(k, v)`` of all ``T`` positions. Positions before ``start`` are not recomputed: their K/V
    come from ``cache`` (the second result of a call on a sequence whose first ``start`` tokens
    are ``ids[:start]``; causal attention makes them independent of what follows)."""
    mode, cap, bias, sink = parse_config(config)
    every, page = retrieval_every(config), retrieval_page(config)
    dense_below, rest = dense_layers(config), retrieval_rest(config)
    anchor = start if decode_only(config) else 0

    def attend(layer, q, k, v):
        if mode == "dense" or layer < dense_below:
            return attention_dense(q, k, v, start)
        return attention_banded(q, k, v, mode, cap, bias, sink, q0=start, every=every, page=page,
                                rest=rest, anchor=anchor)

    return hidden_states_with(model, ids, attend, start, cache)


@torch.no_grad()
def hidden_states_served(model: Llama, ids: torch.Tensor, config: str, prompt_len: int,
                         dense: tuple[torch.Tensor, list] | None = None) -> torch.Tensor:
    """Final-norm hidden states ``[T, dim]`` of ``ids [T]`` served as an engine serves a
    ``+decode`` config (:func:`decode_only`): positions ``[0, prompt_len)`` prefilled with
    dense causal attention, positions ``[prompt_len, T)`` decoded with the config's far view
    over the prompt's K/V (every far page summarized; the first decode step selects).
    ``dense``: ``hidden_states_from(model, ids, "dense")``'s result, when already at hand (its
    K/V of the prompt's positions are the prefill's)."""
    if not decode_only(config):
        raise ValueError(f"config: expected near+decode or ret<K>[-every<N>]+decode[@<S>], "
                         f"got {config!r}")
    if not 0 < prompt_len < ids.shape[0]:
        raise ValueError(f"prompt_len: expected 1..{ids.shape[0] - 1} (a prompt and at least "
                         f"one decoded token), got {prompt_len}")
    hidden, kvs = dense if dense is not None else hidden_states_from(model, ids, "dense")
    tail, _ = hidden_states_from(model, ids, config, prompt_len, kvs)
    return torch.cat([hidden[:prompt_len], tail])


@torch.no_grad()
def selection_churn(model: Llama, ids: torch.Tensor, top_k: int, lags=(1, 2, 4, 8, 16),
                    page: int | None = None):
    """How fast the retrieval far view's choice moves along ``ids`` (under ``ret<top_k>``, on
    pages of ``page`` tokens, default ``PAGE``): per lag ``n``, the share of the pages chosen
    at position ``t`` that were not chosen at ``t - n`` (pages that left the window in between
    count as new), over every layer and every pair of positions that both choose ``top_k``
    pages. This is the copy work a selection does (only new pages are copied) and what a
    selection every ``n`` steps misses. A context with no position of ``top_k`` far pages has
    no pair to count: that raises ValueError."""
    page = page or PAGE
    T = ids.shape[0]
    new = {n: 0 for n in lags}
    total = {n: 0 for n in lags}
    t_all = torch.arange(T, device=ids.device)
    n_pages = far_pages(T, ids.device, page)

    def attend(layer, q, k, v):
        bounds = page_bounds(k, page)
        sel = torch.cat([retrieval_pages(q[i:i + 256], bounds, t_all[i:i + 256], n_pages, top_k)
                         for i in range(0, T, 256)])
        full = sel.sum(dim=1) == top_k
        for n in lags:
            both = full[n:] & full[:-n]
            fresh = (sel[n:] & ~sel[:-n]).sum(dim=1)
            new[n] += int(fresh[both].sum())
            total[n] += int(both.sum()) * top_k
        return attention_banded(q, k, v, "ret", top_k, False, page=page)

    hidden_states_with(model, ids, attend)
    if not any(total.values()):
        raise ValueError(f"selection_churn: no position of the {T} has {top_k} far pages of "
                         f"{page} tokens to choose (a longer context or a smaller top_k)")
    return {n: new[n] / max(total[n], 1) for n in lags}


@torch.no_grad()
def needle_page_ranks(model: Llama, ids: torch.Tensor, span: tuple[int, int], positions,
                      top_k: int, page: int | None = None) -> list[dict]:
    """Where the pages holding tokens ``span = [lo, hi)`` of ``ids`` rank in the retrieval far
    view's choice (``ret<top_k>``, pages of ``page`` tokens), per layer, for the queries at
    ``positions`` (the answer's: the positions whose next token is a key digit): the best
    rank any such page gets by the best bound over the heads and by the bounds summed over
    them (0: the top page), how many of the span's far pages ``far_page_select`` chooses
    (the most at one position) and how many are far, and the far pages there are. The model
    runs under ``ret<top_k>`` (its own choices shape the next layer's input). A span page
    inside the window of a position is not far there and not counted."""
    page = page or PAGE
    t = torch.as_tensor(list(positions), device=ids.device)
    n_pages = far_pages(ids.shape[0], ids.device, page)
    nf = n_pages[t].to(torch.int32)
    want = torch.arange(span[0] // page, (span[1] - 1) // page + 1, device=ids.device)
    far = want[None, :] < nf[:, None].long()                                 # [n, span pages]
    rows = []

    def attend(layer, q, k, v):
        lo, hi = page_bounds(k, page)
        N = lo.shape[1]
        mine = want.clamp(max=N - 1)
        scores = page_scores_ref(q[t], lo.expand(len(t), -1, -1, -1),
                                 hi.expand(len(t), -1, -1, -1), nf)           # [2, n, N]
        best = []
        for s_ in scores:
            rank = (s_[:, :, None] > s_[:, mine][:, None, :]).sum(dim=1)      # pages above each
            best.append(int(torch.where(far, rank, N).min()))
        sel = retrieval_pages(q[t], (lo, hi), t, n_pages, top_k)              # [n, N]
        rows.append({"best_bound_rank": best[0], "summed_rank": best[1],
                     "chosen": int((sel[:, mine] & far).sum(dim=1).max()),
                     "span_far": int(far.sum(dim=1).max()), "far_pages": int(nf.max())})
        return attention_banded(q, k, v, "ret", top_k, False, page=page)

    hidden_states_with(model, ids, attend)
    return rows


def perplexity(model, ids, config) -> float:
    hidden = hidden_states(model, ids, config)
    return math.exp(nll_sum(model, hidden[:-1], ids[1:]) / (ids.shape[0] - 1))


class _MeanSteps:
    """The mean far view's part of a runtime decode step (:func:`sequential_nll`)."""

    def __init__(self, far):
        self.far = far

    def begin(self, drain: bool = False) -> None:
        pass

    def view(self, layer, q, kc, vc):
        self.far.absorb(layer, kc, vc)
        return self.far.view(layer)

    def after(self, layer, q, view, lse) -> None:
        far_k, _, far_bias = view
        self.far.observe(layer, q, far_k, far_bias, lse)

    def end(self) -> None:
        self.far.pull_scores()


class _RetrievalSteps:
    """The retrieval far view's part of a runtime decode step
    (:func:`sequential_nll_retrieval`)."""

    def __init__(self, ret):
        self.ret = ret

    def begin(self, drain: bool = False) -> None:
        self.ret.begin_step(drain)

    def view(self, layer, q, kc, vc):
        self.ret.absorb(layer, kc)
        self.ret.select(layer, q, kc, vc)
        return self.ret.view(layer)

    def after(self, layer, q, view, lse) -> None:
        pass

    def end(self) -> None:
        pass


def _runtime_nll(model: Llama, ids: torch.Tensor, page: int, attach, prefill: int = 0) -> float:
    """Summed next-token NLL of ``ids`` decoded one token at a time through the runtime: a
    :class:`kvops.runtime.Pager` of ``page``-token pages maps the sequence, ``attach(pager)``
    gives the far-view policy's step parts (``_MeanSteps``, ``_RetrievalSteps``), and every
    layer attends through ``torch.ops.kvops.static_sliding_attention`` over its window pages
    plus the policy's far slots. The first ``prefill`` positions attend densely over all their
    pages without the policy (a prefill, token by token), and the first step after them
    drains the policy's summaries (``begin(drain=True)``)."""
    from kvops.runtime import Pager

    T, cfg = ids.shape[0], model.cfg
    pages = -(-T // page)
    pager = Pager(pages, page, max_sessions=1, max_blocks=pages, device="cpu")
    policy = attach(pager)
    pool = torch.zeros(cfg.n_layers, 2, pages, page, cfg.n_kv_heads, cfg.head_dim)
    nw = WINDOW // page
    nll = 0.0
    for t in range(T - 1):
        with pager.frame() as f:
            f.reserve("s", 1)
        decode = t >= prefill
        if decode:
            policy.begin(drain=t == prefill)
        table_ = pager.pages("s")
        here = table_[t // page]
        first = max(0, len(table_) - nw) if decode else 0   # a prefill step sees every page
        win = torch.tensor(table_[first:])
        ws = torch.zeros(1, dtype=torch.int32)
        wl = torch.tensor([t + 1 - first * page], dtype=torch.int32)
        cos, sin = model.rope_cos[t:t + 1], model.rope_sin[t:t + 1]
        x = model.tok_embeddings(ids[t:t + 1])
        for layer, block in enumerate(model.layers):
            att = block.attention
            q, k, v = att._qkv(block.attention_norm(x), cos, sin)
            kc, vc = pool[layer, 0], pool[layer, 1]
            kc[here, t % page], vc[here, t % page] = k[0], v[0]
            view = policy.view(layer, q, kc, vc) if decode else ()
            kw = kc[win].reshape(1, -1, cfg.n_kv_heads, cfg.head_dim)
            vw = vc[win].reshape(1, -1, cfg.n_kv_heads, cfg.head_dim)
            out, lse = torch.ops.kvops.static_sliding_attention(q, kw, vw, ws, wl, *view)
            if decode:
                policy.after(layer, q, view, lse)
            x = x + att.wo(out.flatten(-2))
            x = x + block.feed_forward(block.ffn_norm(x))
        if decode:
            policy.end()
        logits = model.output(model.norm(x)).float()
        nll += F.cross_entropy(logits, ids[t + 1:t + 2], reduction="sum").item()
    return nll


@torch.no_grad()
def sequential_nll_retrieval(model: Llama, ids: torch.Tensor, top_k: int,
                             page: int | None = None, prefill: int = 0) -> float:
    """Summed next-token NLL of ``ids`` decoded one token at a time through the retrieval far
    view of the runtime: a :class:`kvops.runtime.Pager` maps the sequence's pages of ``page``
    tokens (default ``PAGE``), :class:`kvops.runtime.FarRetrieval` summarizes each page as it
    leaves the window (``begin_step`` and ``absorb``) and brings the ``top_k`` pages
    ``far_page_select`` chooses for the step's query exact into its far slots (``select``), and
    every layer attends through ``torch.ops.kvops.static_sliding_attention`` over its window
    pages plus those slots. The same selection as ``ret<top_k>[@<page>]`` in
    :func:`attention_banded`, one decode step per token. ``prefill``: the first positions
    attend densely, and the step after them summarizes every far page at once (what
    ``ret<top_k>+decode[@<page>]`` evaluates, :func:`hidden_states_served`)."""
    from kvops.runtime import FarRetrieval

    page, cfg = page or PAGE, model.cfg

    def attach(pager):
        return _RetrievalSteps(FarRetrieval(
            pager, window_tokens=WINDOW, top_k=min(top_k, pager.max_blocks),
            num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            dtype=torch.float32, max_leave=1))

    return _runtime_nll(model, ids, page, attach, prefill)


@torch.no_grad()
def sequential_nll(model: Llama, ids: torch.Tensor, cap: int, bias: bool, ema: float = 0.9) -> float:
    """Summed next-token NLL of ``ids`` decoded one token at a time through the runtime: a
    :class:`kvops.runtime.Pager` maps the sequence's pages, :class:`kvops.runtime.FarView`
    summarizes chunks as they leave the window and picks ``cap`` of them by EMA utility, and
    every layer attends through ``torch.ops.kvops.static_sliding_attention`` over its window
    pages plus the far view. Works for any cap (the utility ranking chooses when chunks
    outnumber it); costs one decode step per token."""
    from kvops.runtime import FarView

    cfg = model.cfg

    def attach(pager):
        return _MeanSteps(FarView(
            pager, window_tokens=WINDOW, chunk_tokens=CHUNK, cap=cap, num_layers=cfg.n_layers,
            num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=torch.float32, ema=ema,
            log_count_bias=bias))

    return _runtime_nll(model, ids, PAGE, attach)
