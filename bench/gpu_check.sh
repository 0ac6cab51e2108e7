#!/usr/bin/env bash
# One call on the lent GPU machine: install what its image lacks, then run the named stages.
#   bash bench/gpu_check.sh tests dispatch        (carry .whl; results land under $OUT)
# Stages: tests (pytest -m gpu; GPU_TESTS="tests/serving ..." narrows it, GPU_TESTS_TIMEOUT seconds),
#   all-gpu-tests (every GPU test in five pytests at once -> $OUT/gpu_tests.txt, gpu_tests_{a,b,c,d,e}.log;
#   GPU_TESTS_PARTS="c e" runs those parts only),
#   host-tests (the rest of the suite, -m "not gpu", as `make test` runs it on a GPU machine: one pytest -v
#   per test folder, in parallel -> $OUT/host_tests.txt, each folder's summary, their logs in $OUT/host_tests_logs.tar.gz; HOST_TESTS_TIMEOUT seconds;
#   HOST_TESTS="tests/cli tests/suites" runs those folders or files only), dispatch (hit-path
#   overhead benchmark), contention (bench/cpu_contention.py: eager calls beside busy compilers), decode-sweep (bench/decode_sweep.py), decode-ncu (its --profile under
#   Nsight Compute); more are added per area.
#   triton-sweep (whole Triton GEMM config space on sample shapes), triton-tests, gemm
#   (tuner bench gemm; GEMM_BENCH_ARGS="--part odd ...", GEMM_BENCH_TIMEOUT seconds).
#   lowbit (tuner bench gemm --suite lowbit: int4/fp8 beside torch's ops and bf16 cuBLAS ->
#   $OUT/gemm_lowbit.json/.png, gemm_lowbit.db, lowbit_cutlass_cache.tar.xz; LOWBIT_BENCH_ARGS="--part
#   fp8-rowwise ...", LOWBIT_BENCH_TIMEOUT seconds). lowbit-kernels (bench/lowbit_kernels.py -> $OUT/
#   lowbit_kernels.json, .log; LOWBIT_KERNELS_ARGS="--formats int4 ...", LOWBIT_KERNELS_TIMEOUT).
#   int4-layouts (bench/int4_layouts.py: time and memory of each INT4 kernel's weight layout -> $OUT/
#   int4_layouts.json, .log). lowbit-ncu (Nsight Compute sections of the low-bit decode kernels -> $OUT/lowbit_ncu.log).
#   gemv-ncu (the same for the CUDA W4A16 decode kernel, bench/w4a16_decode_grid.py --profile -> $OUT/gemv_ncu.log).
#   gemv-grid (bench/w4a16_decode_grid.py -> $OUT/gemv_grid.json, .log; GEMV_GRID_ARGS="--proj down --m 16
#   --config k,4,2,8,2 ...", GEMV_GRID_TIMEOUT).
#   gemv-ab (bench/w4a16_decode_grid.py from another version's tree AB_TREE and from this one, in turns, then
#   bench/gemv_ab.py -> $OUT/gemv_ab.txt/.json and each run's JSON and log; GEMV_AB_ARGS, GEMV_AB_ROUNDS).
#   tuneall (tune-all Llama-3-8B projections -> $OUT/tuneall: report.json, speedup.png, tuner.db,
#   journal, tunableop_results0.csv; TUNEALL_TIME_LIMIT, TUNEALL_RESUME_FROM, TUNEALL_ARGS).
#   w4a16-prefill (bench/w4a16_prefill.py: INT4 Triton and CUTLASS configs beside bf16 cuBLAS at M >= 256
#   -> $OUT/w4a16_prefill.json, .log; W4A16_PREFILL_ARGS="--m 256 --sweep", W4A16_PREFILL_TIMEOUT).
#   w4a16-streamk (bench/w4a16_streamk.py: the stream-K ws kernel by cluster and grid size beside ws
#   -> $OUT/w4a16_streamk.json, .log; W4A16_STREAMK_ARGS="--ops qkv o --sms 132 66", W4A16_STREAMK_TIMEOUT).
#   streamk-ncu (the same under Nsight Compute, --profile -> $OUT/streamk_ncu.log; STREAMK_NCU_ARGS).
#   fp8-decode (bench/fp8_decode_sweep.py: FP8 rowwise decode configs beside a bare read -> $OUT/fp8_decode.json,
#   .log; FP8_DECODE_ARGS (default "--shortlist --precise": the shortlist in precise mode), FP8_DECODE_TIMEOUT).
#   fp8-prefill (bench/fp8_prefill.py: every FP8 source's configs beside _scaled_mm and bf16 cuBLAS at
#   M = 2048 -> $OUT/fp8_prefill.json, .log, fp8_prefill_cutlass_cache.tar.xz; FP8_PREFILL_ARGS="--sweep",
#   FP8_PREFILL_TIMEOUT).
#   quantized (bench/quantized_decoder.py: a Llama-3-8B layer in bf16, int4 and fp8, torch beside the tuner ->
#   $OUT/quantized_decoder.json/.png; QUANTIZED_ARGS, QUANTIZED_TUNE_DEADLINE, QUANTIZED_TIMEOUT).
#   gaps (bench/graph_gaps.py: kernel chains with bf16 / FP8 GEMMs, each captured several times, idle time
#   between kernels per capture -> $OUT/graph_gaps.json, graph_gaps.log; GAPS_ARGS, GAPS_TIMEOUT).
#   context (bench/graph_context.py: a bf16 layer step served by torch, the tuner, and the tuner for one
#   projection at a time, plain and fenced, beside each projection alone -> $OUT/graph_context.json/.png;
#   CONTEXT_ARGS, CONTEXT_TUNE_DEADLINE, CONTEXT_TIMEOUT; starts from CONTEXT_CACHE if given).
#   libs (cuBLAS/cuBLASLt/CUTLASS: precompile, tests/candidates/test_gemm_libraries.py, bench/libs_bench.py
#   -> $OUT/libs.json, libs_details.json, libs_compile.json, cutlass_cache.tar.xz; LIBS_CUTLASS_SEED).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export TUNER_CACHE=${TUNER_CACHE:-$OUT/tuner.db}
export CUTLASS_CACHE_DIR=${CUTLASS_CACHE_DIR:-/tmp/cutlass_cache}
# CUTLASS_SEED=<cutlass_cache.tar.xz files from earlier calls, space-separated, e.g.
# bench/results/cutlass_cache_h200_sm90.tar.xz> starts every stage with those compiled kernels (cold
# CUTLASS compiles cost 35-52 s each); at most one of them may hold compiled_cache.db (the kernels
# cutlass_cppgen builds): a later one's would replace it, while shared libraries (lib/) add up
# (the seeds the stages write leave out the CUDA W4A16 decode libraries and their markers,
# */cuda_w4a16_*: keyed by the kernel's source and flags, a changed kernel never loads them, so
# they only weigh on the tree (tens of MB), and a marker without its library would be taken for
# a built one; a stage rebuilds them in a minute)
if [ -n "${CUTLASS_SEED:-}" ]; then
  mkdir -p "$CUTLASS_CACHE_DIR"
  for seed in $CUTLASS_SEED; do tar xJf "$seed" -C "$CUTLASS_CACHE_DIR" || exit 1; done
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# the host's CPU and its load: host-side figures (compiles, process starts) move with them
{ echo "CPUs: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"; echo "load average: $(cat /proc/loadavg)"; } | tee -a "$OUT/gpu.txt"
python3 -m tuner info 2>&1 | tee "$OUT/info.txt"
# The device tool brings back at most 8 files: everything is packed into one archive after each
# stage, so a call cut off in a later stage still returns what the earlier ones made (and what a
# command before this script wrote under $OUT). Compiled kernels (the tuner's artifacts/) stay
# out: they would take the archive past the tool's 16 MiB a file.
pack() {
  ( cd "$OUT" && find . -type f ! -name bundle.tar.gz ! -path '*/artifacts/*' | tar -czf /tmp/bundle.tar.gz -T - ) && mv /tmp/bundle.tar.gz "$OUT/bundle.tar.gz"
}
status=0
# SM clock, power, temperature and throttle reasons every 200 ms while the stages run: the time of
# a compute-bound call moves with the clock, and this says what the clock was
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$OUT/clocks.csv" 2>/dev/null &
clock_log=$!
for stage in "$@"; do
  echo "=== stage $stage (load average: $(cut -d' ' -f1-3 /proc/loadavg)) ==="
  case "$stage" in
    tests)  # the schema tests (CPU only) need schemathesis, which the device image lacks;
      # GPU_TESTS_REPEAT=n runs them n times over (a flaky test's failures, counted), each run in the log
      : > "$OUT/gpu_tests.log"
      for run in $(seq "${GPU_TESTS_REPEAT:-1}"); do
        echo "--- tests, run $run of ${GPU_TESTS_REPEAT:-1} ---" >> "$OUT/gpu_tests.log"
        timeout -k 20 "${GPU_TESTS_TIMEOUT:-3000}" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=900 --ignore=tests/server/test_schema.py ${GPU_TESTS:-tests} 2>&1 | tee -a "$OUT/gpu_tests.log"
        rc=${PIPESTATUS[0]}
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # pytest killed: its log ends without a summary
          echo "tests: stopped by GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-3000} s; the tests after the last dot did not run" | tee -a "$OUT/gpu_tests.log"
        fi
        [ "$rc" = 0 ] || status=1
      done ;;
    all-gpu-tests)  # every GPU test in five pytests at once, each with its own tuner cache and log (the
      # kernel caches are shared), the slowest named (--durations): a, the nvcc-heavy candidate files
      # (GPU_TESTS_PART_A lists them); b, the Triton-heavy ones (GPU_TESTS_PART_B); c, the low-bit keys
      # tuned with every source (GPU_TESTS_PART_C); d, every folder but tests/candidates; e, the rest of
      # tests/candidates. With the CUTLASS seed on a fresh machine, run a, b and d in one call, e in another,
      # and c alone (on an H100 its nine keys take most of a call): together they take longer than a call may
      a=${GPU_TESTS_PART_A:-"tests/candidates/test_cutlass_w4a16.py tests/candidates/test_gemm_libraries.py tests/candidates/test_fp8_libs.py tests/candidates/test_cutlass_launcher.py tests/candidates/test_cuda_w4a16.py tests/candidates/test_cuda_fp8.py"}
      b=${GPU_TESTS_PART_B:-"tests/candidates/test_attention.py tests/candidates/test_dequant_gemm.py tests/candidates/test_fp8_decode.py tests/candidates/test_lowbit_kernels.py"}
      c=${GPU_TESTS_PART_C:-"tests/candidates/test_lowbit_sources.py"}
      not_abc=$(for f in $a $b $c; do printf -- ' --ignore=%s' "$f"; done)
      declare -A files=([a]="$a" [b]="$b" [c]="$c" [d]="--ignore=tests/candidates tests" [e]="$not_abc tests/candidates")
      parts=${GPU_TESTS_PARTS:-"a b c d e"} pids=()
      for part in $parts; do
        [ -n "${files[$part]:-}" ] || { echo "GPU_TESTS_PARTS: no part '$part' (allowed: a b c d e)"; exit 2; }
      done
      for part in $parts; do
        # each line stamped with the time it came (a part cut by the timeout has no --durations table)
        ( TUNER_CACHE=/tmp/gpu_tests_$part.db timeout -k 10 "${GPU_TESTS_TIMEOUT:-540}" python3 -m pytest -v -m gpu \
            -p no:cacheprovider --timeout=400 --durations=25 --ignore=tests/server/test_schema.py ${files[$part]} 2>&1 \
            | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done > "$OUT/gpu_tests_$part.log"
          echo "exit $?" >> "$OUT/gpu_tests_$part.log" ) &
        pids+=($!)
      done
      wait "${pids[@]}"
      : > "$OUT/gpu_tests.txt"
      for part in $parts; do
        { echo "== part $part: $(grep -E '(passed|failed|errors?|skipped|no tests ran).* in [0-9.]+s' "$OUT/gpu_tests_$part.log" | tail -1) ($(tail -1 "$OUT/gpu_tests_$part.log"))"
          grep -E '^[0-9:]+ (FAILED|ERROR)' "$OUT/gpu_tests_$part.log"; } | tee -a "$OUT/gpu_tests.txt"
        grep -qx 'exit 0' "$OUT/gpu_tests_$part.log" || status=1
      done ;;
    host-tests)  # CPU-path tests on a GPU host: a GPU-less host's tests are marked cpu_host
      logs=$(mktemp -d) pids=()
      for dir in ${HOST_TESTS:-tests/*/ tests/test_*.py}; do
        name=$(echo "${dir%/}" | tr / _)  # tests/cli -> tests_cli: one log a path
        ( timeout -k 20 "${HOST_TESTS_TIMEOUT:-500}" python3 -m pytest -v -m "not gpu" -p no:cacheprovider \
            --ignore=tests/server/test_schema.py "$dir" > "$logs/$name.log" 2>&1
          echo $? > "$logs/$name.rc" ) &
        pids+=($!)
      done
      wait "${pids[@]}"  # not a bare wait: the clock logger runs in the background until the end
      for log in "$logs"/*.log; do  # exit 124 / 137: cut by the timeout; 5: every test deselected
        name=$(basename "$log" .log)
        echo "== $name (exit $(cat "$logs/$name.rc")): $(grep -E '(passed|failed|error|no tests ran|deselected)' "$log" | tail -1)"
        grep -E '^(FAILED|ERROR)' "$log"
      done | tee "$OUT/host_tests.txt"
      tar -czf "$OUT/host_tests_logs.tar.gz" -C "$logs" .  # one file: the tool brings back at most 8
      if grep -qE '^(FAILED|ERROR)|\(exit ([1-46-9]|[0-9]{2,})\)' "$OUT/host_tests.txt"; then status=1; fi ;;
    decode-sweep)  # split-KV decode on small batches: floor read, copy, torch, a wide config grid
      timeout -k 20 "${DECODE_SWEEP_TIMEOUT:-240}" python3 bench/decode_sweep.py --out "$OUT/decode_sweep.json" \
        --time-limit "${DECODE_SWEEP_LIMIT:-200}" ${DECODE_SWEEP_ARGS:-} 2>&1 | tee "$OUT/decode_sweep.log" || status=1 ;;
    decode-ncu)  # Nsight Compute counters of the floor read and two decode configs (q1 b1 kv8k)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout -k 20 "${DECODE_NCU_TIMEOUT:-240}" "$NCU" --clock-control none -k "regex:${DECODE_NCU_KERNELS:-_read_kv|_decode}" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/decode_sweep.py --out /dev/null --profile 2>&1 | tee "$OUT/decode_ncu.log" || status=1 ;;
    lowbit-ncu)  # Nsight Compute counters of the low-bit decode kernels: each once (NVTX range
      # "profile") after a warm-up; LOWBIT_NCU_ARGS (default: int4, gate_up + down, M 1 and 16)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout -k 20 "${LOWBIT_NCU_TIMEOUT:-300}" "$NCU" --clock-control none --nvtx --nvtx-include "profile/" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
        python3 bench/lowbit_kernels.py --out /dev/null --profile ${LOWBIT_NCU_ARGS:---formats int4 --proj gate_up down --m 1 16} \
        2>&1 | tee "$OUT/lowbit_ncu.log" || status=1 ;;
    gemv-ncu)  # Nsight Compute counters of the CUDA W4A16 decode kernel beside the bare read: pipes,
      # issue, warp states and each stall reason's cycles an issue; GEMV_NCU_ARGS (default: gate_up + down, M 1 and 8, PROFILED's configs)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout -k 20 "${GEMV_NCU_TIMEOUT:-300}" "$NCU" --clock-control none --nvtx --nvtx-include "profile/" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 bench/w4a16_decode_grid.py --out /dev/null --profile ${GEMV_NCU_ARGS:---proj gate_up down --m 1 8} \
        2>&1 | tee "$OUT/gemv_ncu.log" || status=1 ;;
    gemv-grid) timeout -k 20 "${GEMV_GRID_TIMEOUT:-300}" python3 bench/w4a16_decode_grid.py --out "$OUT/gemv_grid.json" \
        ${GEMV_GRID_ARGS:-} 2>&1 | tee "$OUT/gemv_grid.log" || status=1 ;;
    gemv-ab)  # an A/B of whole runs, for a change w4a16_decode_grid.py --baseline cannot time (one that
      # moves the weight's layout): AB_TREE holds another version's tuner/ and bench/, e.g.
      # `git archive main tuner bench ':(exclude)bench/results' | tar -x -C ab_main` (a folder
      # .git/info/exclude ignores, carried); its run and this tree's take GEMV_AB_ROUNDS
      # (default 2) turns on this machine with GEMV_AB_ARGS
      if [ ! -d "${AB_TREE:-}/tuner" ]; then
        echo "gemv-ab: AB_TREE='${AB_TREE:-}' holds no tuner/ (another version's tree)"; status=1
      else
        sides=() ab_script=bench/w4a16_decode_grid.py  # older trees name it bench/w4a16_gemv.py
        [ -f "$AB_TREE/$ab_script" ] || ab_script=bench/w4a16_gemv.py
        for round in $(seq "${GEMV_AB_ROUNDS:-2}"); do
          ( cd "$AB_TREE" && export PYTHONPATH="$PWD:$PYTHONPATH" && timeout -k 20 "${GEMV_AB_TIMEOUT:-200}" \
            python3 "$ab_script" --out "$OUT/gemv_ab_base$round.json" ${GEMV_AB_ARGS:-} ) \
            > "$OUT/gemv_ab_base$round.log" 2>&1 || status=1
          timeout -k 20 "${GEMV_AB_TIMEOUT:-200}" python3 bench/w4a16_decode_grid.py --out "$OUT/gemv_ab_new$round.json" \
            ${GEMV_AB_ARGS:-} > "$OUT/gemv_ab_new$round.log" 2>&1 || status=1
          sides+=(--base "$OUT/gemv_ab_base$round.json" --new "$OUT/gemv_ab_new$round.json")
        done
        python3 bench/gemv_ab.py "${sides[@]}" --out "$OUT/gemv_ab.json" 2>&1 | tee "$OUT/gemv_ab.txt" || status=1
      fi ;;
    dispatch) python3 bench/dispatch_overhead.py --out "$OUT/dispatch_overhead.json" || status=1 ;;
    contention) python3 bench/cpu_contention.py --out "$OUT/cpu_contention.json" 2>&1 | tee "$OUT/cpu_contention.log" || status=1 ;;
    sdpa-tests) python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=300 tests/candidates/test_attention.py 2>&1 | tee "$OUT/sdpa_tests.log" || status=1 ;;
    sdpa) timeout -k 20 "${SDPA_BENCH_TIMEOUT:-215}" python3 -m tuner bench sdpa --out "$OUT" ${SDPA_BENCH_ARGS:-} 2>&1 | tee "$OUT/sdpa_bench.log" || status=1 ;;
    triton-sweep) timeout -k 20 "${TRITON_SWEEP_TIMEOUT:-150}" python3 bench/triton_gemm_sweep.py --out "$OUT/triton_sweep.json" ${TRITON_SWEEP_ARGS:-} 2>&1 | tee -a "$OUT/triton.log" || status=1 ;;
    triton-tests) timeout -k 20 "${TRITON_TESTS_TIMEOUT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/candidates/test_triton_gemm.py 2>&1 | tee -a "$OUT/triton.log" || status=1 ;;
    lowbit) timeout -k 20 "${LOWBIT_BENCH_TIMEOUT:-560}" python3 -m tuner bench gemm --suite lowbit --out "$OUT" ${LOWBIT_BENCH_ARGS:-} 2>&1 | tee "$OUT/lowbit_bench.log" || status=1
      tar cJf "$OUT/lowbit_cutlass_cache.tar.xz" -C "$CUTLASS_CACHE_DIR" --exclude=./work --exclude='./*/cuda_w4a16_*' . || status=1 ;;
    int4-layouts) timeout -k 20 "${INT4_LAYOUTS_TIMEOUT:-120}" python3 -m bench.int4_layouts --out "$OUT/int4_layouts.json" 2>&1 | tee "$OUT/int4_layouts.log" || status=1 ;;
    lowbit-kernels) timeout -k 20 "${LOWBIT_KERNELS_TIMEOUT:-400}" python3 bench/lowbit_kernels.py --out "$OUT/lowbit_kernels.json" ${LOWBIT_KERNELS_ARGS:-} 2>&1 | tee "$OUT/lowbit_kernels.log" || status=1 ;;
    w4a16-streamk) timeout -k 20 "${W4A16_STREAMK_TIMEOUT:-200}" python3 bench/w4a16_streamk.py --out "$OUT/w4a16_streamk.json" ${W4A16_STREAMK_ARGS:-} 2>&1 | tee "$OUT/w4a16_streamk.log" || status=1 ;;
    streamk-ncu)  # Nsight Compute sections of the ws kernel and the stream-K ws kernels (Qwen qkv, M = 256)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout -k 20 "${STREAMK_NCU_TIMEOUT:-200}" "$NCU" --clock-control none --kernel-name regex:device_kernel \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section SourceCounters \
        python3 bench/w4a16_streamk.py --out "$OUT/streamk_ncu.json" --profile ${STREAMK_NCU_ARGS:---ops qkv --sms 132} 2>&1 | tee "$OUT/streamk_ncu.log" || status=1 ;;
    w4a16-prefill) timeout -k 20 "${W4A16_PREFILL_TIMEOUT:-250}" python3 bench/w4a16_prefill.py --out "$OUT/w4a16_prefill.json" ${W4A16_PREFILL_ARGS:-} 2>&1 | tee "$OUT/w4a16_prefill.log" || status=1 ;;
    fp8-decode) timeout -k 20 "${FP8_DECODE_TIMEOUT:-250}" python3 bench/fp8_decode_sweep.py --out "$OUT/fp8_decode.json" ${FP8_DECODE_ARGS:---shortlist --precise} 2>&1 | tee "$OUT/fp8_decode.log" || status=1 ;;
    fp8-prefill) timeout -k 20 "${FP8_PREFILL_TIMEOUT:-250}" python3 bench/fp8_prefill.py --out "$OUT/fp8_prefill.json" ${FP8_PREFILL_ARGS:-} 2>&1 | tee "$OUT/fp8_prefill.log" || status=1
      tar cJf "$OUT/fp8_prefill_cutlass_cache.tar.xz" -C "$CUTLASS_CACHE_DIR" --exclude=./work --exclude='./*/cuda_w4a16_*' . || status=1 ;;
    gemm) timeout -k 20 "${GEMM_BENCH_TIMEOUT:-560}" python3 -m tuner bench gemm --out "$OUT" ${GEMM_BENCH_ARGS:-} 2>&1 | tee "$OUT/gemm_bench.log" || status=1 ;;
    tuneall)  # tune-all over Llama-3-8B's projections (M 1..8192, bf16) on every GPU; resumable:
      # TUNEALL_RESUME_FROM=<an earlier $OUT/tuneall dir> continues that run's cache and journal
      mkdir -p "$OUT/tuneall"
      if [ -n "${TUNEALL_RESUME_FROM:-}" ]; then cp "$TUNEALL_RESUME_FROM"/tuner.db "$TUNEALL_RESUME_FROM"/tuner*.tune-all.jsonl "$OUT/tuneall/" || status=1; fi
      timeout -k 20 "${TUNEALL_TIMEOUT:-570}" python3 -m tuner tune-all --cache "$OUT/tuneall/tuner.db" \
        --model configs/models/llama-3-8b.yaml --op gemm --time-limit "${TUNEALL_TIME_LIMIT:-420}" \
        --problem-timeout "${TUNEALL_PROBLEM_TIMEOUT:-240}" --out "$OUT/tuneall" ${TUNEALL_ARGS:-} 2>&1 | tee "$OUT/tuneall/tune_all.log" || status=1
      python3 -m tuner tunableop export --force "$OUT/tuneall/tunableop_results0.csv" --cache "$OUT/tuneall/tuner.db" 2>&1 | tee -a "$OUT/tuneall/tune_all.log" || status=1 ;;
    libs)  # cuBLAS / cuBLASLt / CUTLASS sources: compile, GPU tests, best vs torch.matmul, details
      # LIBS_CUTLASS_SEED=<cutlass_cache.tar.xz of an earlier call> starts with its compiled kernels
      if [ -n "${LIBS_CUTLASS_SEED:-}" ]; then mkdir -p "$CUTLASS_CACHE_DIR" && tar xJf "$LIBS_CUTLASS_SEED" -C "$CUTLASS_CACHE_DIR" || status=1; fi
      timeout -k 20 "${LIBS_COMPILE_TIMEOUT:-400}" python3 bench/libs_bench.py --precompile --out "$OUT/libs_compile.json" 2>&1 | tee "$OUT/libs.log" || status=1
      timeout -k 20 "${LIBS_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/candidates/test_gemm_libraries.py 2>&1 | tee -a "$OUT/libs.log" || status=1
      timeout -k 20 "${LIBS_TABLE_TIMEOUT:-300}" python3 bench/libs_bench.py --out "$OUT/libs.json" 2>&1 | tee -a "$OUT/libs.log" || status=1
      timeout -k 20 "${LIBS_DETAILS_TIMEOUT:-120}" python3 bench/libs_bench.py --details --out "$OUT/libs_details.json" 2>&1 | tee -a "$OUT/libs.log" || status=1
      tar cJf "$OUT/cutlass_cache.tar.xz" -C "$CUTLASS_CACHE_DIR" --exclude=./work --exclude='./*/cuda_w4a16_*' . || status=1 ;;
    dropin)  # tuner.torch on a Llama-3-8B decoder layer (bf16): records its problems, tunes the
      # missing ones, times prefill/decode eager and CUDA-graph, tuner on vs off -> dropin_decoder.json/.png
      # Starts from DROPIN_CACHE (default: this call's tuneall cache, if any); DROPIN_ARGS, DROPIN_TUNE_DEADLINE.
      src=${DROPIN_CACHE:-$OUT/tuneall/tuner.db}
      if [ -f "$src" ]; then cp "$src" "$OUT/dropin_tuner.db" || status=1; fi
      TUNER_CACHE="$OUT/dropin_tuner.db" timeout -k 20 "${DROPIN_TIMEOUT:-570}" python3 bench/dropin_decoder.py \
        --out "$OUT/dropin_decoder.json" --plot "$OUT/dropin_decoder.png" \
        --tune-deadline-s "${DROPIN_TUNE_DEADLINE:-330}" ${DROPIN_ARGS:-} 2>&1 | tee "$OUT/dropin.log" || status=1 ;;
    gaps)  # idle time between a graph's kernels, per capture of one step: graph_gaps.json, .log; GAPS_ARGS
      timeout -k 20 "${GAPS_TIMEOUT:-300}" python3 bench/graph_gaps.py --out "$OUT/graph_gaps.json" ${GAPS_ARGS:-} 2>&1 \
        | tee "$OUT/graph_gaps.log" || status=1 ;;
    quantized)  # quantize_linear on a Llama-3-8B decoder layer: bf16, int4 and fp8 served by torch and by
      # the tuner, decode (graph, eager) and prefill, plus the activations' quantization alone ->
      # quantized_decoder.json/.png, quantized_tuner.db; QUANTIZED_ARGS, QUANTIZED_TUNE_DEADLINE.
      TUNER_CACHE="$OUT/quantized_tuner.db" timeout -k 20 "${QUANTIZED_TIMEOUT:-570}" python3 bench/quantized_decoder.py \
        --out "$OUT/quantized_decoder.json" --plot "$OUT/quantized_decoder.png" \
        --tune-deadline-s "${QUANTIZED_TUNE_DEADLINE:-300}" ${QUANTIZED_ARGS:-} 2>&1 | tee "$OUT/quantized.log" || status=1 ;;
    context)  # a tuned projection's lead alone against its saving in a bf16 layer step (graph times)
      if [ -n "${CONTEXT_CACHE:-}" ]; then cp "$CONTEXT_CACHE" "$OUT/context_tuner.db" || status=1; fi
      TUNER_CACHE="$OUT/context_tuner.db" timeout -k 20 "${CONTEXT_TIMEOUT:-400}" python3 bench/graph_context.py \
        --out "$OUT/graph_context.json" --plot "$OUT/graph_context.png" \
        --tune-deadline-s "${CONTEXT_TUNE_DEADLINE:-200}" ${CONTEXT_ARGS:-} 2>&1 | tee "$OUT/context.log" || status=1 ;;
    cold-start)  # cold tune-all of Qwen2.5-7B GEMMs + the suite's odd shapes on empty caches, CUTLASS
      # on; COLD_START_PART=cold (pruned), everything (--no-prune), warm (cold's problems again on
      # its caches, --force), fleet (again, kernels fetched
      # from a local tuner serve) and/or first-call (after tuner sync, with and without warmup), in
      # the order given (e.g. "cold fleet first-call"); results accumulate in $OUT/cold_start/cold_start.json (COLD_START_FROM=<earlier
      # cold_start.json> to compare parts). A cold run's cache and kernels are kept in
      # /tmp/cold_start_cold for a later fleet / first-call call on this machine, which otherwise
      # runs the cold tune-all itself first.
      mkdir -p "$OUT/cold_start"; kept=/tmp/cold_start_cold
      if [ -n "${COLD_START_FROM:-}" ]; then cp "$COLD_START_FROM" "$OUT/cold_start/cold_start.json" || status=1; fi
      from=(); if [ -f "$kept/artifacts/index.db" ]; then from=(--cold-from "$kept"); fi
      timeout -k 20 "${COLD_START_TIMEOUT:-570}" python3 bench/cold_start.py --out "$OUT/cold_start" "${from[@]}" \
        --part ${COLD_START_PART:-cold} --problem-timeout "${COLD_START_PROBLEM_TIMEOUT:-120}" ${COLD_START_ARGS:-} 2>&1 | tee "$OUT/cold_start.log" || status=1
      if [ -f "$OUT/cold_start/cold/artifacts/index.db" ]; then
        rm -rf "$kept" && mkdir -p "$kept" && cp -r "$OUT"/cold_start/cold/{tuner.db,report.json,artifacts} "$kept"/
      fi
      find "$OUT/cold_start" -depth -type d \( -name triton -o -name cutlass -o -name artifacts -o -name '*.artifacts' \) -exec rm -rf {} + ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  pack
done
kill "$clock_log" 2>/dev/null
pack
exit $status
