"""Launch rules are pure functions of shapes and device properties: a table of their choices on
an H200 (132 SMs, 227 KiB of shared memory a program, sm_90, compiled) and on the interpreter's
4-SM model. docs/tuning.md gives the measurement behind each rule; a change to a rule changes
this table and that page together."""

from __future__ import annotations

import pytest

from kvops.kernels._common import DeviceProps, grid_waves, kv_block_n
from kvops.kernels._splitk import default_num_splits, merge_warps, use_pdl
from kvops.kernels.elastic_attention import elastic_launch, in_flight_tiles, native_dense_tile
from kvops.kernels.far_page_select import choice_in_kernel, choice_launch
from kvops.kernels.far_view_rank import rank_launch
from kvops.kernels.static_sliding_attention import far_tile, sliding_launch

H200 = DeviceProps(132, 227 * 1024, (9, 0), True)
A100 = DeviceProps(108, 163 * 1024, (8, 0), True)
INTERP = DeviceProps(4, 227 * 1024, (0, 0), False)


# (B, Hkv, W, D, C far slots, props) -> (block_n, splits, warps, stages)
SLIDING = [
    ((1, 8, 8192, 128, 0, H200), (128, 16, 4, 3)),     # Llama-3-8B, one sequence: split
    ((4, 8, 32768, 128, 0, H200), (128, 4, 4, 3)),
    ((16, 8, 4096, 128, 0, H200), (128, 1, 4, 3)),     # 128 programs: one full wave
    ((64, 8, 2048, 128, 0, H200), (128, 1, 4, 3)),
    ((128, 8, 1024, 128, 0, H200), (64, 1, 4, 3)),     # short windows, > 1 program an SM
    ((64, 8, 1024, 128, 16, H200), (64, 1, 4, 3)),     # ... a 1k window and 16 far summaries
    ((64, 4, 1024, 128, 128, H200), (64, 1, 4, 3)),    # ... up to 128 far slots (SHORT_SHARED)
    ((64, 8, 1024, 128, 129, H200), (128, 1, 4, 3)),   # past SHORT_SHARED: wave_tile, full waves
    ((9, 8, 1024, 128, 16, H200), (64, 3, 4, 3)),      # one program an SM, past SHORT_WINDOW:
                                                       # wave_tile's partial wave, re-split
    ((128, 1, 1024, 128, 0, H200), (128, 1, 4, 3)),    # ... one wave of programs: 128 rows
    ((128, 2, 1024, 128, 0, H200), (64, 1, 4, 3)),
    ((128, 4, 1024, 256, 0, H200), (64, 1, 4, 3)),     # D 256: 64-row tiles already
    ((9, 8, 4096, 128, 0, H200), (64, 3, 4, 3)),       # partial wave: 64-row tiles, re-split
    ((9, 8, 3072, 128, 1024, H200), (64, 3, 4, 3)),    # far slots are rows: as W 4096
    ((16, 8, 512, 128, 1024, H200), (128, 1, 4, 3)),   # W 512 + 1024 far: one program
    ((1, 8, 8192, 128, 64, H200), (128, 16, 4, 3)),    # a mean far view of 64 slots
    ((16, 4, 4096, 256, 0, H200), (64, 2, 4, 3)),      # D 256: 64-row tiles
    ((4, 2, 512, 512, 0, H200), (32, 8, 4, 3)),        # D 512: 32-row tiles
    ((3, 2, 1100, 128, 0, INTERP), (64, 1, 4, 3)),     # 6 programs on 4 SMs
]


@pytest.mark.parametrize("args,want", SLIDING, ids=[str(a[:5]) for a, _ in SLIDING])
def test_sliding_launch_table(args, want):
    assert tuple(sliding_launch(*args[:4], 2, *args[4:])) == want


# (C far slots, window tile rows) -> far tile rows
FAR_TILE = [((1, 128), 16), ((9, 64), 16), ((16, 128), 16), ((17, 128), 32), ((64, 128), 64),
            ((512, 128), 128), ((100, 64), 64), ((3, 16), 16)]


@pytest.mark.parametrize("args,want", FAR_TILE, ids=[str(a) for a, _ in FAR_TILE])
def test_far_tile_table(args, want):
    assert far_tile(*args) == want


def test_sliding_launch_keeps_given_knobs():
    got = sliding_launch(128, 1, 1024, 128, 2, 0, H200, block_n=32, splits=3, warps=8,
                         stages=4)
    assert tuple(got) == (32, 3, 8, 4)


# (mode, B, Hkv, G, NB, S, D, props) -> (block_n, splits, warps, stages, base_stages)
ELASTIC = [
    ((0, 16, 8, 4, 256, 16, 128, H200), (128, 1, 4, 5, 5)),      # native dense: one wave
    ((0, 128, 1, 8, 64, 16, 128, H200), (128, 1, 4, 5, 5)),
    ((0, 16, 8, 4, 256, 16, 128, A100), (16, 3, 1, 5, 5)),       # no dense shape on 163 KiB
    ((0, 1, 8, 4, 1024, 16, 128, H200), (16, 64, 1, 5, 5)),      # one sequence: 64 splits
    ((0, 128, 8, 4, 64, 16, 128, H200), (16, 1, 1, 5, 5)),
    ((0, 128, 2, 4, 64, 16, 128, H200), (64, 1, 4, 5, 5)),      # two waves: 64-row dense
    ((0, 128, 3, 4, 64, 16, 128, H200), (16, 1, 1, 5, 5)),      # three waves: one-warp programs
    ((1, 128, 8, 4, 256, 64, 128, H200), (32, 1, 1, 4, 5)),      # mixed, >= 6 programs an SM
    ((1, 64, 8, 4, 256, 16, 128, H200), (32, 1, 1, 5, 7)),      # BASE runs a buffer deeper
    ((2, 16, 8, 4, 1024, 16, 128, H200), (32, 4, 1, 5, 7)),
    ((0, 4, 4, 2, 64, 16, 256, H200), (16, 16, 4, 5, 5)),        # D 256: 4 warps
    ((0, 16, 32, 1, 256, 16, 96, H200), (16, 1, 1, 5, 5)),       # Phi-3: 512 pairs, two tiles
                                                                  # in flight each: unsplit
    ((0, 1, 32, 1, 512, 16, 128, H200), (16, 16, 1, 5, 5)),      # MHA, one 8k sequence
    ((0, 4, 4, 7, 2048, 16, 128, H200), (16, 33, 1, 5, 5)),      # Qwen2.5-7B B 4 x 32k
    ((0, 16, 8, 4, 256, 16, 128, H200, 3), (16, 8, 1, 3, 3)),    # 3 stages: one tile in flight
    ((0, 16, 8, 4, 256, 16, 128, H200, 7), (16, 2, 1, 7, 7)),    # 7 stages: three
]


@pytest.mark.parametrize("args,want", ELASTIC, ids=[str(a[:7]) for a, _ in ELASTIC])
def test_elastic_launch_table(args, want):
    mode, B, Hkv, G, NB, S, D, props, *stages = args
    got = elastic_launch(mode, B, Hkv, G, NB, S, D, 2, props, stages=stages[0] if stages else None)
    assert tuple(got)[:5] == want


def test_in_flight_tiles_counts_buffered_tiles_on_the_native_path_only():
    assert [in_flight_tiles(0, st) for st in (1, 2, 3, 4, 5, 6, 7)] == [1, 1, 1, 1, 2, 2, 3]
    assert in_flight_tiles(1, 5) == in_flight_tiles(2, 7) == in_flight_tiles(0, None) == 1


def test_native_dense_tile_needs_one_full_wave_and_the_shared_memory():
    assert native_dense_tile(128, 4, 128, 2, H200) == (128, 1)
    assert native_dense_tile(100, 4, 128, 2, H200) is None          # 76 % of the SMs
    assert native_dense_tile(200, 4, 128, 2, H200) is None          # two waves, 76 % full
    assert native_dense_tile(256, 4, 128, 2, H200) == (64, 1)       # two waves, 97 %: 64 rows
    assert native_dense_tile(300, 4, 128, 2, H200) is None          # three waves
    assert native_dense_tile(128, 4, 128, 2, A100) is None


@pytest.mark.parametrize("pairs,rows,want", [
    (64, 2048, (128, 2)),       # 8/1 at B 64 x 2k: two splits fill 97 % of the wave
    (64, 4096, (128, 2)),       # Qwen2.5-7B's 28/4 at B 16 x 4k
    (53, 2048, (128, 2)),       # 80 %
    (52, 2048, None),           # 79 %
    (67, 2048, None),           # two splits make two waves
    (64, 256, None),            # a split of 128 rows: one tile
    (64, 512, (128, 2)),        # two tiles a split
    (64, None, None),           # rows unknown
    (8, 16384, None),           # B 1 x 16k would need 16 splits: one-warp programs
])
def test_native_dense_tile_splits_in_two_where_that_fills_the_wave(pairs, rows, want):
    assert native_dense_tile(pairs, 8, 128, 2, H200, rows) == want


def test_elastic_launch_takes_the_split_dense_shape_on_the_native_path_only():
    native = elastic_launch(0, 64, 1, 8, 128, 16, 128, 2, H200)
    assert (native.block_n, native.splits, native.warps, native.stages) == (128, 2, 4, 5)
    mixed = elastic_launch(1, 64, 1, 8, 128, 16, 128, 2, H200)
    assert (mixed.block_n, mixed.warps) == (32, 1)


@pytest.mark.parametrize("pairs,n,block_n,tile,sms,want", [
    (8, 8192, 128, 65536, 132, 16),
    (128, 4096, 128, 65536, 132, 1),
    (1, 256, 128, 65536, 132, 1),         # at least 2 tiles a split
    (1, 1 << 20, 16, 8192, 132, 64),      # at most 64
    (3, 4096, 64, 32768, 132, 32),        # at least 2 tiles a split
])
def test_default_num_splits(pairs, n, block_n, tile, sms, want):
    assert default_num_splits(pairs, n, block_n, tile, sms) == want


def test_small_rules():
    assert grid_waves(264, 132) == (2, 1.0)
    assert grid_waves(133, 132)[0] == 2
    assert kv_block_n(128, 2) == 128 and kv_block_n(256, 2) == 64 and kv_block_n(512, 2) == 32
    assert kv_block_n(64, 4) == 128 and kv_block_n(128, 4) == 64
    assert merge_warps(128) == 4 and merge_warps(64) == 2
    assert use_pdl(H200) and not use_pdl(A100) and not use_pdl(INTERP)


# J chunks a row -> (BLOCK_J, warps)
RANK = [(1, (1, 4)), (60, (64, 4)), (1024, (1024, 4)), (1025, (2048, 8)), (4096, (4096, 8))]


@pytest.mark.parametrize("J,want", RANK, ids=[str(j) for j, _ in RANK])
def test_rank_launch_table(J, want):
    assert rank_launch(J) == want


# N far pages a row -> (BLOCK_N, warps) of far_page_select's choice kernel
CHOICE = [(1, (1, 8)), (500, (512, 8)), (2048, (2048, 8)), (4096, (4096, 8)),
          (4097, (8192, 16)), (8192, (8192, 16))]


@pytest.mark.parametrize("N,want", CHOICE, ids=[str(n) for n, _ in CHOICE])
def test_choice_launch_table(N, want):
    assert choice_launch(N) == want


def test_choice_in_kernel_up_to_16384_pages():
    assert choice_in_kernel(1) and choice_in_kernel(16384) and not choice_in_kernel(16385)
