#!/usr/bin/env bash
# One check-and-benchmark pass on a GPU machine, as the device tool runs it: each part under its
# own time cap, its log in $OUT/<part>.log, every results file it records copied to $OUT, and a
# short table of the parts last. Parts are named on the command line (default: all, in order):
#   bench/gpu_pass.sh suite tests ops replay eager heads fidelity farret elastic elastic_steady engine tp tp_more transformers elastic_ablations
#   (and eager_python, prefill, prefill_s64, sharegpt, ceilings, engine_reversed; mooncake_a, mooncake_b, mooncake_c: one Mooncake window a call)
# and everything under $OUT is packed into $OUT/gpu-pass.tgz at the end.
# The device machine's copied .git can lag the tree it runs, so a call names the tree's commit:
#   KVOPS_COMMIT=<sha> bash bench/gpu_pass.sh ...   (results headers print it; see records.commit_id)
set -u
OUT=${OUT:-/tmp/gpu-pass}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
before=$(ls bench/results)
declare -a rows

part() {   # part NAME SECONDS COMMAND...
    local name=$1 cap=$2; shift 2
    local t0=$SECONDS
    timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    rows+=("| $name | $rc | $((SECONDS - t0)) | $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-90) |")
    grep -E ' (FAILED|ERROR) ' "$OUT/$name.log" | sed 's/^/    /' | head -20
}

tests() {
    part tests 150 python3 -m pytest -v -n 14 --timeout 140 -rfE -p no:cacheprovider \
        tests/test_far_page_ops.py tests/test_paged_prefill_attention.py::test_long_prefill_on_cuda \
        tests/test_tp.py tests/test_transformers_fidelity.py tests/test_transformers_integration.py \
        tests/test_bench_transformers.py tests/test_fidelity.py tests/test_engine.py \
        tests/test_far_view_policy.py tests/test_engine_elastic.py tests/test_evals_elastic.py \
        tests/test_far_slot_update.py tests/test_far_retrieval_policy.py tests/test_fidelity_host_cost.py \
        tests/test_op_contract.py
}
ops() {        # the ops' and launchers' CUDA tests (about 2 minutes once compiled; the first
    # compiles of a fresh machine take longer)
    part ops 280 python3 -m pytest -q -n 14 --timeout 270 -rfE -p no:cacheprovider \
        tests/test_far_view_observe.py tests/test_far_view_rank.py tests/test_far_page_ops.py \
        tests/test_far_view_summarize.py tests/test_far_slot_update.py tests/test_paged_kv_write.py \
        tests/test_base_pairs.py tests/test_elastic_attention.py tests/test_static_sliding_attention.py \
        tests/test_split_merge.py tests/test_op_contract.py tests/test_launch_direct.py \
        tests/test_host_signatures.py tests/test_paged_prefill_attention.py tests/test_workspace.py \
        tests/test_launch_rules.py
}
replay() {     # the ops' C++ dispatch kernel: build it, check every op's replay against Python,
    # and the eager table with it (the ops part after it runs every op test with it installed)
    part build-kernel 150 python3 -m kvops build-kernel --verbose
    part replay-tests 200 python3 -m pytest -q -n 4 --timeout 190 -rfE -p no:cacheprovider \
        tests/test_replay.py tests/test_replay_spec.py
    part eager-replay 100 python3 -m bench.bench_eager
}
eager_python() {   # the eager table with every op's Python implementation as its CUDA kernel
    KVOPS_REPLAY=0 part eager-python 100 python3 -m bench.bench_eager --name eager-python
}
eager() {      # every op's eager host time beside SDPA's (issue 19's table)
    part eager 90 python3 -m bench.bench_eager
}
heads() {      # the decode ops over the quick sweep's head configs against the best SDPA backend
    part heads 150 python3 -m bench.bench_heads --quick
}
suite() {      # the whole suite (issue 18's "passes on the device"); about 7 minutes on 16 workers
    part suite 560 python3 -m pytest -q -n 16 --timeout 500 -rfE -p no:cacheprovider
}
prefill() {    # the prefill op's whole test file, then its quick bench with the chunk's rows at pages of 16 (prefill_s64: of 64)
    part prefill-tests 230 python3 -m pytest -q -n 8 --timeout 220 -rfE -p no:cacheprovider \
        tests/test_paged_prefill_attention.py
    part prefill-s16 150 python3 -m bench.bench_paged_prefill --quick --no-flex --page 16 --new-rows
}
prefill_s64() {
    part prefill-s64 150 python3 -m bench.bench_paged_prefill --quick --no-flex --page 64 --new-rows
}
fidelity() {
    part fidelity 90 python3 -m bench.bench_fidelity_host --device cuda
}
farret() {
    part farret 150 python3 -m bench.bench_far_view --retrieval
}
ceilings() {   # the card's own streaming-read and copy ceilings (the benches quote the H200's)
    part ceilings 60 python3 -m bench.bench_ceilings
}
engine() {
    part engine 420 python3 -m kvops replay --configs static,pager,pager+merge,kvrm,kvrm-ret,paged \
        --max-requests 40 --record engine-table5-synthetic-8b --out "$OUT/engine" --no-progress --no-figures
    part engine-steps 30 python3 -m bench.engine_steps "$OUT/engine/replay.json" --slowest 8
}
engine_reversed() {   # the same replay with `static` last: what running first costs a configuration
    part engine-reversed 240 python3 -m kvops replay --configs paged,kvrm,static \
        --max-requests 40 --record engine-table5-synthetic-8b-static-last --out "$OUT/engine-reversed" \
        --no-progress --no-figures
    part engine-reversed-steps 30 python3 -m bench.engine_steps "$OUT/engine-reversed/replay.json" --slowest 8
}
elastic() {     # the KV-bound sweep (about 5 minutes, docs/elastickv.md)
    part elastic 480 python3 -m kvops replay --mode elastic --record elastic-pressure-8b-kvbound \
        --out "$OUT/elastic" --no-progress
}
elastic_steady() {   # concurrency 40 only, 16 requests a client (the paper's ~600 at 38): the P90 past the first wave
    part elastic-steady 400 python3 -m kvops replay --mode elastic --sweep 40 --requests-per-client 16 \
        --record elastic-pressure-8b-steady --out "$OUT/elastic-steady" --no-progress --no-figures
}
elastic_ablations() {
    part elastic-ablations 300 python3 -m kvops replay --mode elastic --sweep 40 \
        --configs elastic,elastic-watermark,elastic-eager-promote,elastic-no-promote,elastic-general \
        --record elastic-ablations-8b --out "$OUT/elastic-ablations" --no-progress
}
mooncake_window() {   # mooncake_window W: one 37.5 s Mooncake window (W 0, 1, 2 = A, B, C) at a
    # 16,384-token budget, prompts clipped to fit Llama-3-8B's 8,192 positions, where Eff@300
    # separates the managers (docs/elastickv.md); each target-only manager stops once its
    # Eff@300 cannot reach elastic's (--eff-bar elastic).
    # The trace is read from $KVOPS_TRACES (the device gets no ../shared: copy the traces into
    # an ignored folder of the checkout, carry it and name it there)
    part "mooncake-$1" 560 python3 -m kvops replay --mode elastic \
        --trace "${KVOPS_TRACES:-../shared/data/traces}/mooncake_conversation_trace.jsonl" \
        --sweep "$1" --thin 8 --time-scale 0.125 --budget-tokens 16384 --max-context 8192 \
        --configs elastic,offload,reserve,paged --eff-bar elastic \
        --record "elastic-mooncake-window-$1-8b" --out "$OUT/mooncake-$1" --no-progress
}
mooncake_a() { mooncake_window 0; }
mooncake_b() { mooncake_window 1; }
mooncake_c() { mooncake_window 2; }
tp() {
    part tp 80 python3 -m bench.bench_tp --configs static,pager+merge,paged
}
tp_more() {
    part tp-eager 80 python3 -m bench.bench_tp --configs static,paged --no-graphs --name tp1-distributed-path-eager
    part tp-fp32 80 python3 -m bench.bench_tp --configs static,paged --dtype float32 --name tp1-distributed-path-fp32
}
transformers() {      # issue 22's grid: B 1, 16, 64 x 4k, 16k, against SDPA and flex
    part transformers 420 python3 -m bench.bench_transformers --record
}

for p in "${@:-tests fidelity farret elastic engine tp transformers}"; do
    for q in $p; do $q; done
done
for f in $(ls bench/results); do
    grep -qx "$f" <<< "$before" || cp "bench/results/$f" "$OUT/"
done
# The device tool brings back at most 8 files: everything goes back as one archive.
(cd "$OUT" && tar czf ../gpu-pass.tgz . && rm -rf ./* && mv ../gpu-pass.tgz .)
echo
echo "| part | rc | s | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
