#!/usr/bin/env bash
# One device call: the GPU tests of the runtime, then the decode benchmarks; logs and JSON under $OUT, tables last.
# Usage (repository root on the GPU machine): OUT=/tmp/out bash benchmarks/gpu_run.sh [quick|tests-1|tests-2|needle|mech|bench|full|budget|peers|variants|decode|kernels|keybits-tests|keybits-bench|pin-tests|pin-bench|compile-tests|compile-bench|prefill|softcap-a|softcap-b|gemma2-bench|rotate-prefill|profile|first-steps|floor|floor-sweep|channel-tests|channel-bench|channel-generate|blockq|budget-codec]
# quick: tests + the 100K/8K batch-1 rows; bench: those rows only; full: tests + every row of RESULTS.md;
# budget: tests + the 100K batch 1/8 rows, the 100 GB KV-budget rows and the eager OSCAR rows (peak memory)
# peers: no tests; installs the wheels under .whl/peers (if any: optimum-quanto, hqq and their small deps, --no-deps),
#   builds quanto's CUDA extension once (logged; quanto compiles it with nvcc on first use), then OSCAR, bf16graph and
#   transformers' QuantizedCache INT2 rows at $CONTEXTS (default "32768 100000"), batches 1 and 8
# variants: the decode, merge, quantize and attention GPU tests, then bench_decode.py --sweep-variants (programmatic
#   dependent launch off/on × rescale slack 0/8)
# decode: the decode-kernel and static-step GPU tests, then the headline decode rows (bench_decode.py --quick)
# kernels: the quantize/pack, decode-kernel and merge GPU tests (≈ 7.5 min on a fresh machine: most of it is Triton
#   compiling the tested variants), then the quantize/pack rows (both builds) and the headline decode rows: the first
#   thing to run after a kernel change, within one 10-minute call
# keybits-tests: the quantize/pack, decode-kernel, merge, rotate and static-step GPU tests (3-bit keys included)
# keybits-bench: no tests; quantize/pack at 2 and 3 bits, the headline decode rows with 2- and 3-bit keys, and
#   generate() at 100K batch 1 and 8 with 2-bit keys and with calibrate's default (--key-bits 2.7), same call
# pin-tests: the pinned-token, static-step and attention GPU tests (docs/format.md §6c)
# pin-bench: no tests; generate() at 100K batch 1 and 8 with calibrate's default keys (--key-bits 2.7), without and
#   with 32 pinned tokens (calibrate --pin 32), same call
# compile-tests: the compiled-step, static-step and attention GPU tests (runtime/compiled.py: generate() replaying
#   inductor-compiled layers around the OSCAR custom op, every supported architecture)
# compile-bench: no tests; generate() at 100K and 32K, batch 1 (BATCHES), OSCAR and bf16graph with compiled layers
#   (--compile), then with eager layers (--no-compile), each pair in one run
# prefill: no tests; time to first token at 8K, 32K, 100K (batch 1) and 32K batch 8, OSCAR vs DynamicCache and the
#   preallocated BF16 cache (benchmarks/bench_prefill.py), peak memory beside; REPEATS (1) timed runs per row, median
# channel-tests: the per-channel-key GPU tests (docs/format.md §6d: channel quantize, decode, generate replays), then
#   the static-step and compiled-step GPU tests
# channel-bench: no tests; quantize/pack of key blocks (128 tokens) at 2 and 3 bits, the headline decode rows with keys
#   per row and per channel (64- and 128-token blocks) at 2 and 3 bits
# channel-generate: no tests; generate() at 100K batch 1 and 8 with calibrate's key bits (2.7), keys per row vs per
#   channel over 128-token blocks, same call
# blockq: the channel decode GPU tests, then the decode rows with keys per row and per channel (128-token blocks) at 2
#   and 3 bits (the block-query prepass), again at 2 bits with q·s folded per tile (OSCAR_BLOCK_QUERY=0), and
#   generate() at 100K batch 1 and 8 (calibrate's key bits 2.7), keys per channel then per row (OSCAR rows only)
# tests-1: the GPU tests outside the kernel files, eight at a time (pytest-xdist), then the compiled-step tests in
#   order (≈ 3.5 min in a fresh machine's call); tests-2: the quantize/pack
#   and decode-kernel GPU tests, twelve at a time (≈ 4 min): the two calls together are the whole GPU suite
# needle: no tests; `verify --needle`'s loop with the demo model's real weights (benchmarks/bench_needle.py --weights):
#   the LENGTHS (1024,2048,4096) grid at depths 0.1 … 0.9, TRIALS (20) prompts per cell and depth, SEEDS (100),
#   BATCH (20) prompts per batch, for ARTIFACTS ("default=artifacts/demo"), on HAYSTACKS (plays) with NEEDLES (passkey)
#   in each PROTOCOL (follow-up; "follow-up prompt" runs both, each under $OUT/PROTOCOL: needle.log, the summary and
#   the per-run reports packed as runs.tgz, which `benchmarks/needle_pool.py` reads once unpacked), starting no run
#   after BUDGET (420) s per protocol. The weights travel in parts:
#   here, `bash benchmarks/needle_weights.sh` writes .cache/needle and .cache/w/partNN; each earlier call of the same
#   warm machine carries one part and sets WEIGHTS_PART=.cache/w/partNN (any mode), the needle call carries the last
#   part, .cache/needle and artifacts (bench_needle and needle_mechanism need torch, triton and transformers only);
#   MECH (arguments) then runs experiments/needle_mechanism.py there; mech: the weights, then MECH's harness only
# softcap-a: the decode-kernel and dequantize GPU tests, the headline decode rows, then time to first token (OSCAR and
#   bf16graph: the later chunks' past dequantized straight into the chunk's dtype)
# softcap-b: the compiled-step, static-step and attention GPU tests (Gemma2's softcap in the decode kernel, captured),
#   then generate() on Gemma2-2B shapes at 4,000 tokens, batch 1 and 8: OSCAR captured and compiled, OSCAR eager (how
#   Gemma2 decoded before), the BF16 graph (its decode kernel capped alike) and DynamicCache (also alone: gemma2-bench)
# rotate-prefill: a prompt chunk's rotations as a split bfloat16 GEMM (rotate_op.rotate_chunk): its GPU test and the
#   GPU tests of the prefill paths, then time to first token at 32K and 100K: OSCAR, OSCAR with float32 rotations
#   (the A/B row) and bf16graph
# budget-codec: no tests; the 100 GB KV-budget rows at 100K with the shipped codec (calibrate's defaults: --key-bits 2.7,
#   keys per channel over 128-token blocks) and compiled layers, beside 100K batch 1 and 8, then the same rows with
#   eager OSCAR (--no-graph) for the peak-memory comparison (needs an H200: 100 GB of KV; BUDGET_GB=50 fits an H100)
# first-steps: no tests; one generate() in a fresh process (empty Triton and inductor caches), 100K prompt, 2,000 steps,
#   CUDA graphs of compiled layers: every step's time (benchmarks/bench_first_steps.py)
# floor: no tests; ncu's full set on the decode kernel with calibrate's codec (3-bit keys per channel over 128-token
#   blocks) at batch 8 and 1, 100K, and batch 8, 32K (duration, DRAM and L2 throughput, instructions, issue, warps per
#   scheduler, occupancy; details under $OUT; the stalls per instruction: floor-sweep), then bench_decode.py --floor
#   with the same keys
# floor-sweep: no tests; the decode kernel of the batch-8, 100K row with calibrate's codec profiled per SASS instruction
#   (ncu --import-source; the instructions with the most L2 sectors, excess sectors, shared wavefronts, instructions and
#   stall samples: experiments/ncu_source_top.py), then bench_decode.py --floor --sweep with those keys (each head dim's
#   launch candidates on its rows), then the floor rows with keys of 2 and 3 bits, per row and per channel
# profile: no tests; ncu at the SM's own clock (--clock-control none) on the decode and merge kernels of the 100K
#   batch-1 row (durations, issue, warps, registers) for the settings in force and for two-warp programs, then the
#   full set on the decode kernel at 100K batch 1 and 32K batch 32 (key lines printed, details and raw CSV under $OUT)
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
mode=${1:-quick}
if [ -n "${WEIGHTS_PART:-}" ]; then  # kept in /tmp while this machine stays warm (see needle)
  mkdir -p /tmp/w && cp "$WEIGHTS_PART" /tmp/w/ && ls -l /tmp/w
fi
if [ "$mode" = needle ] || [ "$mode" = mech ]; then
  model=.cache/needle/models/SmolLM2-135M-Instruct-bf16
  cat /tmp/w/part?? | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    > "$model/model.safetensors" || exit 1
  [ "$(sha256sum "$model/model.safetensors" | cut -c1-64)" = "$(cat "$model/sha256")" ] || { echo "weights: sha256 differs"; exit 1; }
  if [ "$mode" = needle ]; then
    for protocol in ${PROTOCOL:-follow-up}; do  # each protocol's runs and summary under $OUT/PROTOCOL
      mkdir -p "$OUT/$protocol"
      OUT="$OUT/$protocol" python3 -m benchmarks.bench_needle --model-dir "$model" --weights \
        --texts .cache/needle/texts --lengths "${LENGTHS:-1024,2048,4096}" --depths 0.1,0.3,0.5,0.7,0.9 \
        --trials "${TRIALS:-20}" --seeds ${SEEDS:-100} --batch "${BATCH:-20}" --time-budget "${BUDGET:-420}" \
        --baselines none --haystacks "${HAYSTACKS:-plays}" --needles "${NEEDLES:-passkey}" --protocol "$protocol" \
        --artifacts ${ARTIFACTS:-default=artifacts/demo} 2>&1 | grep -v "^Loading" | tee "$OUT/$protocol/needle.log"
      # one file for the per-run reports (the device machine sends back a few files per call): runs.tgz
      ( cd "$OUT/$protocol" && ls bench_needle_*.json | grep -v summary | tar czf runs.tgz --remove-files -T - )
    done
  fi
  if [ -n "${MECH:-}" ]; then  # the harness: MECH="--haystack poems,docs --needle name,code --trials 8 …", MECH_ONLY
    # its variants, ";"-separated (default: all)
    OSCAR_ZOO_CACHE=.cache/needle python3 -m benchmarks.experiments.needle_mechanism --device cuda \
      --texts .cache/needle/texts --json "$OUT/needle_mechanism.json" $MECH ${MECH_ONLY:+--only "$MECH_ONLY"} 2>&1 \
      | tee "$OUT/needle_mechanism.log"
  fi
  exit 0
fi
if [ "$mode" = tests-1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/runtime --ignore tests/runtime/test_real_model.py \
    --ignore tests/runtime/test_compiled_step.py --ignore tests/runtime/test_decode_kernels.py \
    --ignore tests/runtime/test_quantize_channel_kernel.py --ignore tests/runtime/test_quantize_pack_kernel.py \
    2>&1 | tee "$OUT/test_gpu_1.log" | tail -5
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_compiled_step.py --tb=short 2>&1 \
    | tee "$OUT/test_gpu_compiled.log" | tail -8
  exit 0
fi
if [ "$mode" = tests-2 ]; then
  timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 tests/runtime/test_decode_kernels.py \
    tests/runtime/test_quantize_channel_kernel.py tests/runtime/test_quantize_pack_kernel.py 2>&1 \
    | tee "$OUT/test_gpu_2.log" | tail -5
  exit 0
fi
if [ "$mode" = peers ]; then
  ls .whl/peers/*.whl >/dev/null 2>&1 && python3 -m pip install --quiet --no-deps .whl/peers/*.whl
  ( time python3 -c "import torch, optimum.quanto.library.extensions as e; print(e.get_extension('quanto_cuda').lib)" ) \
    > "$OUT/quanto_build.log" 2>&1; tail -4 "$OUT/quanto_build.log"
  python3 -m benchmarks.bench_generate --contexts ${CONTEXTS:-32768 100000} --batches 1 8 \
    --kinds oscar bf16graph hf-quanto-int2 hf-hqq-int2 --budget-contexts --phases 100000:1 \
    2>&1 | tee "$OUT/bench_generate_peers.log" | tail -30
  exit 0
fi
if [ "$mode" = profile ]; then
  metrics=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
  metrics=$metrics,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread
  for cfg in 64,1,3,8,0 64,2,3,8,128; do
    ncu --clock-control none -k regex:'_decode_kernel|_merge' --launch-skip 4 --launch-count 2 --metrics "$metrics" \
      python3 -m benchmarks.experiments.profile_decode --context 100000 --config $cfg \
      > "$OUT/ncu_metrics_${cfg//,/_}.log" 2>&1
    echo "== $cfg"; grep -E "_decode_kernel|_merge|duration|issue_active|warps_active|registers" "$OUT/ncu_metrics_${cfg//,/_}.log"
  done
  for row in "1 100000" "32 32768"; do
    set -- $row
    ncu --clock-control none -k regex:'_decode_kernel' --launch-skip 4 --launch-count 1 --set full -o "$OUT/decode_b$1" \
      python3 -m benchmarks.experiments.profile_decode --batch "$1" --context "$2" > "$OUT/ncu_b$1.log" 2>&1
    ncu --import "$OUT/decode_b$1.ncu-rep" --page details --print-units base > "$OUT/details_b$1.txt" 2>&1
    ncu --import "$OUT/decode_b$1.ncu-rep" --page raw --csv > "$OUT/raw_b$1.csv" 2>&1
    echo "== batch $1, context $2"
    grep -E "^    (Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Waves Per SM)" \
      "$OUT/details_b$1.txt"
    rm -f "$OUT/decode_b$1.ncu-rep"
  done
  exit 0
fi
if [ "$mode" = first-steps ]; then
  python3 -m benchmarks.bench_first_steps --path graph --context 100000 --steps 2000 \
    --json "$OUT/first_steps_graph.json" 2>&1 | tee "$OUT/first_steps_graph.log" | grep -v "^Loading"
  exit 0
fi
if [ "$mode" = floor-sweep ]; then
  ncu --clock-control none -k regex:'_decode_kernel' --launch-skip 4 --launch-count 1 --set full --import-source yes \
    -o "$OUT/src" python3 -m benchmarks.experiments.profile_decode --batch 8 --context 100000 --key-bits 3 \
    --key-block 128 > "$OUT/src.log" 2>&1
  # per SASS instruction (Triton's kernels do not always correlate with their Python lines)
  ncu --import "$OUT/src.ncu-rep" --page source --print-source sass --csv > "$OUT/src_sass.csv" 2>&1
  python3 -m benchmarks.experiments.ncu_source_top "$OUT/src_sass.csv" 8 > "$OUT/top_sass.txt" 2>&1
  gzip -f "$OUT/src_sass.csv"
  rm -f "$OUT/src.ncu-rep"
  grep -A9 -E "^== (L2 Theoretical Sectors Global|L2 Theoretical Sectors Global Excessive|Warp Stall Sampling \(All Samples\)):" \
    "$OUT/top_sass.txt"
  python3 -m benchmarks.bench_decode --floor --sweep --key-bits 3 --key-block 128 2>&1 | tee "$OUT/sweep.log" \
    | grep '^sweep'
  python3 -m benchmarks.bench_decode --floor --key-bits 2 3 --key-block 0 128 2>&1 | tee "$OUT/bench_decode.log" \
    | tail -26
  exit 0
fi
if [ "$mode" = floor ]; then
  for row in "8 100000" "1 100000" "8 32768"; do
    set -- $row
    ncu --clock-control none -k regex:'_decode_kernel' --launch-skip 4 --launch-count 1 --set full -o "$OUT/floor_b$1_$2" \
      python3 -m benchmarks.experiments.profile_decode --batch "$1" --context "$2" --key-bits 3 --key-block 128 \
      > "$OUT/floor_b$1_$2.log" 2>&1
    ncu --import "$OUT/floor_b$1_$2.ncu-rep" --page details --print-units base > "$OUT/floor_details_b$1_$2.txt" 2>&1
    rm -f "$OUT/floor_b$1_$2.ncu-rep"
    echo "== batch $1, context $2, 3-bit keys per channel over 128-token blocks"
    grep -E "^    (Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate|Executed Instructions  |Issue Slots Busy|\
Executed Ipc Active|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Achieved Occupancy|\
Warp Cycles Per Issued|Registers Per Thread|Block Limit Registers|Waves Per SM|Grid Size)" \
      "$OUT/floor_details_b$1_$2.txt"
  done
  python3 -m benchmarks.bench_decode --floor --key-bits 3 --key-block 128 2>&1 | tee "$OUT/bench_decode.log" | tail -9
  exit 0
fi
if [ "$mode" = channel-tests ]; then
  timeout 580 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_channel_keys.py \
    tests/runtime/test_quantize_channel_kernel.py tests/runtime/test_decode_kernels.py -k "channel" \
    --durations 10 2>&1 | tee "$OUT/test_gpu_channel.log" | tail -15
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_static_step.py \
    tests/runtime/test_compiled_step.py -x 2>&1 | tee "$OUT/test_gpu_steps.log" | tail -5
  exit 0
fi
if [ "$mode" = channel-bench ]; then
  python3 -m benchmarks.bench_quantize --bits 2 3 --key-block 128 2>&1 | tee "$OUT/bench_quantize.log" | tail -14
  python3 -m benchmarks.bench_decode --quick --key-bits 2 3 --key-block 0 64 128 2>&1 | tee "$OUT/bench_decode.log" \
    | tail -46
  exit 0
fi
if [ "$mode" = channel-generate ]; then
  for blk in ${BLOCKS:-0 128}; do
    python3 -m benchmarks.bench_generate --contexts 100000 --batches 1 8 --budget-contexts --phases --key-bits 2.7 \
      --key-block $blk 2>&1 | tee "$OUT/bench_generate_block$blk.log" | grep -E "^\|"
    [ -f "$OUT/bench_generate_qwen3-8b.json" ] && mv "$OUT/bench_generate_qwen3-8b.json" "$OUT/bench_generate_block$blk.json"
  done
  exit 0
fi
if [ "$mode" = blockq ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_decode_kernels.py -k channel 2>&1 \
    | tee "$OUT/test_gpu_channel_decode.log" | tail -2
  python3 -m benchmarks.bench_decode --quick --key-bits 2 3 --key-block 0 128 2>&1 | tee "$OUT/bench_decode.log" | tail -32
  [ -f "$OUT/bench_decode.json" ] && mv "$OUT/bench_decode.json" "$OUT/bench_decode_blockq.json"
  OSCAR_BLOCK_QUERY=0 python3 -m benchmarks.bench_decode --quick --key-bits 2 --key-block 128 2>&1 \
    | tee "$OUT/bench_decode_fold.log" | tail -10
  for blk in 128 0; do
    python3 -m benchmarks.bench_generate --kinds oscar --contexts 100000 --batches 1 8 --budget-contexts --phases \
      --key-bits 2.7 --key-block $blk 2>&1 | tee "$OUT/bench_generate_block$blk.log" | grep -E "^\|"
    [ -f "$OUT/bench_generate_qwen3-8b.json" ] && mv "$OUT/bench_generate_qwen3-8b.json" "$OUT/bench_generate_block$blk.json"
  done
  exit 0
fi
if [ "$mode" = keybits-tests ]; then
  timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_quantize_pack_kernel.py \
    tests/runtime/test_decode_kernels.py tests/runtime/test_merge_kernel.py tests/runtime/test_rotate_kernel.py \
    tests/runtime/test_static_step.py --durations 15 2>&1 | tee "$OUT/test_gpu.log" | tail -25
  exit 0
fi
if [ "$mode" = pin-tests ]; then
  timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_pinned.py \
    tests/runtime/test_static_step.py tests/runtime/test_attention.py --durations 10 2>&1 | tee "$OUT/test_gpu.log" | tail -20
  exit 0
fi
if [ "$mode" = compile-tests ]; then
  timeout 580 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_compiled_step.py \
    tests/runtime/test_static_step.py --durations 10 2>&1 | tee "$OUT/test_gpu.log" | tail -25
  exit 0
fi
if [ "$mode" = compile-bench ]; then
  for flag in ${FLAGS:---compile --no-compile}; do
    python3 -m benchmarks.bench_generate --contexts ${CONTEXTS:-100000 32768} --batches ${BATCHES:-1} --budget-contexts \
      --phases --key-bits 2.7 $flag 2>&1 | tee "$OUT/bench_generate$flag.log" | grep -E "^\||compiled|eager layers|kernels "
  done
  exit 0
fi
if [ "$mode" = softcap-a ]; then
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 tests/runtime/test_decode_kernels.py \
    tests/runtime/test_dequant_kernel.py 2>&1 | tee "$OUT/test_gpu_a.log" | tail -5
  timeout 150 python3 -m benchmarks.bench_decode --quick 2>&1 | tee "$OUT/bench_decode.log" | tail -10
  timeout 260 python3 -m benchmarks.bench_prefill --kinds oscar bf16graph 2>&1 | tee "$OUT/bench_prefill.log" | grep -E "^\|"
  exit 0
fi
if [ "$mode" = softcap-b ]; then
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_compiled_step.py \
    tests/runtime/test_static_step.py tests/runtime/test_attention.py --tb=short 2>&1 | tee "$OUT/test_gpu_b.log" | tail -8
  GEMMA2_BENCH=1
fi
g2="-m benchmarks.bench_generate --model gemma2-2b --contexts 4000 --budget-contexts --phases"
if [ "$mode" = rotate-prefill ]; then  # ordered so that a call cut short keeps the most
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_rotate_kernel.py \
    tests/runtime/test_pinned.py tests/runtime/test_attention.py tests/runtime/test_channel_keys.py --tb=short 2>&1 \
    | tee "$OUT/test_gpu_rotate.log" | tail -5
  timeout 300 python3 -m benchmarks.bench_prefill --kinds oscar oscar-fp32rot bf16graph --contexts 32768 100000 \
    --extra 2>&1 | tee "$OUT/bench_prefill.log" | grep -E "^\|"
  exit 0
fi
if [ "$mode" = gemma2-bench ] || [ -n "${GEMMA2_BENCH:-}" ]; then
  timeout 200 python3 $g2 --batches 1 8 --kinds oscar bf16graph 2>&1 | tee "$OUT/bench_gemma2.log" | grep -E "^ctx"
  timeout 150 python3 $g2 --batches ${EAGER_BATCHES:-1 8} --kinds oscar dynamic --no-graph 2>&1 \
    | tee "$OUT/bench_gemma2_eager.log" | grep -E "^ctx"
  exit 0
fi
if [ "$mode" = prefill ]; then
  python3 -m benchmarks.bench_prefill --repeats "${REPEATS:-1}" 2>&1 | tee "$OUT/bench_prefill.log" | grep -E "^\|"
  exit 0
fi
if [ "$mode" = pin-bench ]; then
  for pin in 0 32; do
    python3 -m benchmarks.bench_generate --contexts 100000 --batches 1 8 --budget-contexts --phases --key-bits 2.7 \
      --pin $pin 2>&1 | tee "$OUT/bench_generate_pin$pin.log" | tail -8
    [ -f "$OUT/bench_generate_qwen3-8b.json" ] && mv "$OUT/bench_generate_qwen3-8b.json" "$OUT/bench_generate_pin$pin.json"
  done
  exit 0
fi
if [ "$mode" = keybits-bench ]; then
  python3 -m benchmarks.bench_quantize --bits 2 3 2>&1 | tee "$OUT/bench_quantize.log" | tail -14
  python3 -m benchmarks.bench_decode --quick --key-bits 2 3 2>&1 | tee "$OUT/bench_decode.log" | tail -14
  for kb in 2 2.7; do
    python3 -m benchmarks.bench_generate --contexts 100000 --batches 1 8 --budget-contexts --phases --key-bits $kb \
      2>&1 | tee "$OUT/bench_generate_k$kb.log" | tail -8
    [ -f "$OUT/bench_generate_qwen3-8b.json" ] && mv "$OUT/bench_generate_qwen3-8b.json" "$OUT/bench_generate_k$kb.json"
  done
  exit 0
fi
if [ "$mode" = decode ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_decode_kernels.py tests/runtime/test_static_step.py \
    2>&1 | tee "$OUT/test_gpu.log" | tail -3
  python3 -m benchmarks.bench_decode --quick 2>&1 | tee "$OUT/bench_decode.log" | tail -10
  exit 0
fi
if [ "$mode" = variants ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_decode_kernels.py tests/runtime/test_merge_kernel.py \
    tests/runtime/test_quantize_pack_kernel.py tests/runtime/test_attention.py 2>&1 | tee "$OUT/test_gpu.log" | tail -8
  python3 -m benchmarks.bench_decode --sweep-variants 2>&1 | tee "$OUT/bench_decode_variants.log" | grep '^variant'
  exit 0
fi
if [ "$mode" = kernels ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_quantize_pack_kernel.py \
    tests/runtime/test_decode_kernels.py tests/runtime/test_merge_kernel.py 2>&1 | tee "$OUT/test_gpu.log" | tail -3
  python3 -m benchmarks.bench_quantize --both-builds 2>&1 | tee "$OUT/bench_quantize.log" | tail -14
  python3 -m benchmarks.bench_decode --quick 2>&1 | tee "$OUT/bench_decode.log" | tail -10
  exit 0
fi
if [ "$mode" = budget-codec ]; then
  codec="--key-bits 2.7 --key-block 128"
  timeout ${LIMIT:-400} python3 -m benchmarks.bench_generate --contexts 100000 --batches 1 8 --budget-contexts 100000 \
    --budget-gb ${BUDGET_GB:-100} --phases $codec 2>&1 | tee "$OUT/bench_generate_budget.log" | grep -E "^\||^budget"
  [ -f "$OUT/bench_generate_qwen3-8b.json" ] && mv "$OUT/bench_generate_qwen3-8b.json" "$OUT/bench_generate_budget.json"
  python3 -m benchmarks.bench_generate --no-graph --kinds oscar --contexts 100000 --batches 1 8 --budget-contexts \
    --phases $codec 2>&1 | tee "$OUT/bench_generate_eager.log" | grep -E "^\|"
  exit 0
fi
if [ "$mode" != bench ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime --ignore tests/runtime/test_real_model.py 2>&1 | tee "$OUT/test_gpu.log" | tail -15
fi
if [ "$mode" = budget ]; then
  python3 -m benchmarks.bench_generate --contexts 100000 --batches 1 8 --budget-contexts 100000 --phases \
    2>&1 | tee "$OUT/bench_generate.log" | tail -14
  OUT= python3 -m benchmarks.bench_generate --no-graph --kinds oscar --contexts 100000 --batches 1 8 --budget-contexts \
    --phases 2>&1 | tee "$OUT/bench_generate_eager.log" | tail -6
elif [ "$mode" != full ]; then
  python3 -m benchmarks.bench_generate --contexts 100000 8192 --batches 1 --budget-contexts --phases \
    2>&1 | tee "$OUT/bench_generate.log" | tail -12
else
  python3 -m benchmarks.bench_generate --contexts 8192 32768 100000 131072 --batches 1 8 32 --budget-contexts 100000 \
    --phases 2>&1 | tee "$OUT/bench_generate.log" | tail -40
  python3 -m benchmarks.bench_generate --model smollm2 --contexts 8192 32768 100000 --batches 1 8 32 \
    --budget-contexts --phases 2>&1 | tee "$OUT/bench_generate_smollm2.log" | tail -16
  OUT= python3 -m benchmarks.bench_generate --no-graph --kinds oscar --contexts 100000 --batches 1 8 --budget-contexts \
    --phases 2>&1 | tee "$OUT/bench_generate_eager.log" | tail -6
fi
