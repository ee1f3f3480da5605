#!/usr/bin/env bash
# Builds deltastack on the H200 device machine and runs every test there, GPU tests included, then
# compute-sanitizer on the small GPU tests, the op probe, GPU forward parity, and the benchmarks.
# Usage (device tool, from the repo root, with `.deps` and `third_party/cudnn_frontend` carried): scripts/device_test.sh [stage ...]
# Stages: env build prebuilt base-modes base-bench ncu-conv ab test test-gpu sanitize probe parity train peft-load nccl real-shapes bench-ops peer peer-step peer-lora torch cpu-blas bench-step memory curves fp8 fp8-ab curves-fp8 curves-modes train-27b
# (default: all but test-gpu, which runs only the CUDA tests; peer, which times fla's kernels: scripts/peer_bench.py;
# peer-step, full training steps, ours vs the strongest PyTorch peer: scripts/peer_step.py, PEER_RUNS;
# peer-lora, LoRA steps, ours (bench step --lora-rank) vs transformers + PEFT LoRA: scripts/peer_lora_step.py, LORA_RUNS;
# peft-load, a GPU LoRA run's exported adapter loaded by PEFT onto transformers' model vs our forward --adapter on the
# GPU and the CPU: scripts/check_peft_load.py, PEFT_STEPS;
# torch, deltastack.torch: the extension, python/tests, scripts/torch_step.py (docs/torch.md);
# memory, bench step at the memory modes' shapes (MEMORY_RUNS); curves, 0.8B fp32 vs bf16 state loss curves
# (CURVE_DATA); fp8, bench step in bf16 and fp8 (FP8_RUNS); fp8-ab, FP8 with the amax fused vs an amax pass per cast (FP8_AB_RUNS); curves-fp8, FP8 vs bf16 loss curves on the corpus (CURVE_RUNS); curves-modes, each mode's curve against the exact one (CURVE_SPECS); bench-ops-base, the .base binary's bench ops (A/B); harness, the chunked GDN harness (tests,
# per-phase timings); ncu-gdn, hardware counters of its kernels; ncu-step, every kernel's time in a 2B step;
# ab, bench step under several environment settings, alternating (AB_ARGS, AB_ENVS, AB_ROUNDS);
# profile-step, `bench step --profile` (ms per op family / role, gaps) beside the plain bench step (its overhead);
# corpus, a real-text corpus in /tmp/ds_corpus.txt; train-9b, 9B 20 steps + resume on it; train-27b, 27B 20 steps,
# its checkpoint in /dev/shm, a bitwise resume, an export;
# train-bf16 / train-8bit, the default run with --optimizer-state bf16 / 8bit: twice and resumed, bitwise; cpu-blas, the CPU engine's
# OpenBLAS kernel choice on this host's CPU, 2 pinned cores; prebuilt, instead of build: the binaries
# scripts/prebuild_device.sh packed, carried in .prebuilt). BUILD_TARGET builds one target.
# With a source tree of an earlier commit in .base (e.g.
# `git archive <commit> src CMakeLists.txt scripts | tar -x -C .base`, carried), `build` also builds its binary
# (build-base) and `train` / `bench-step` compare against it: losses bitwise, step time.
# The device image has no Debian -dev packages and no network, so the Debian 12 packages the build needs
# travel as .deb files in .deps/ (scripts/fetch_device_deps.sh) and are unpacked into a private sysroot.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ds_out}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build test sanitize probe parity train real-shapes bench-ops bench-step)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
SYS=/tmp/ds_sysroot
if [ ! -d "$SYS/usr" ]; then
  mkdir -p "$SYS"
  # .deps (every package, for a build) or the runtime packages a `prebuilt` pack carries (scripts/prebuild_device.sh).
  for f in .deps/*.deb .prebuilt/deps/*.deb; do [ -f "$f" ] && dpkg -x "$f" "$SYS"; done
fi
export PKG_CONFIG_SYSROOT_DIR=$SYS
export PKG_CONFIG_LIBDIR=$SYS/usr/lib/x86_64-linux-gnu/pkgconfig:$SYS/usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig:$SYS/usr/share/pkgconfig
export LD_LIBRARY_PATH=$SYS/usr/lib/x86_64-linux-gnu:$SYS/usr/lib/x86_64-linux-gnu/openblas-pthread:${LD_LIBRARY_PATH:-}
PKGCONF=$(command -v pkg-config || echo "$SYS/usr/bin/pkgconf")
# cuDNN lives inside PyTorch's wheel there: its headers for the build, its libcudnn.so.9 for dlopen at run time.
CUDNN_DIR=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2>/dev/null || true)
if [ -n "$CUDNN_DIR" ]; then
  export CUDNN_INCLUDE_DIR=$CUDNN_DIR/include
  export LD_LIBRARY_PATH=$CUDNN_DIR/lib:$LD_LIBRARY_PATH
fi
# NCCL too (the GPU engine's communicator): nccl.h for the build, libnccl.so.2 for dlopen at run time.
NCCL_DIR=$(python3 -c "import nvidia.nccl as c; print(list(c.__path__)[0])" 2>/dev/null || true)
if [ -n "$NCCL_DIR" ]; then
  export NCCL_INCLUDE_DIR=$NCCL_DIR/include
  export LD_LIBRARY_PATH=$NCCL_DIR/lib:$LD_LIBRARY_PATH
fi
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines (the device tool's KINDS.md)
# A prebuilt pack (scripts/prebuild_device.sh) carries the peers' packages and Triton autotune records: unpacked
# here when .peers itself is not carried.
if [ ! -d .peers/site ] && [ -f .prebuilt/peers.tar.xz ]; then
  mkdir -p .peers && tar -xJf .prebuilt/peers.tar.xz -C .peers || echo "warning: unpacking .prebuilt/peers.tar.xz failed"
fi
# The peers' Triton kernels (fla, Liger): compiled kernels and autotune winners on disk (TRITON_CACHE_AUTOTUNING=1),
# in .peers/triton_cache. A cold peer call compiles every autotune configuration of fla's kernels (146-182 s of
# warm-up at 9B); with the winners' records carried it compiles only the winners. PEER_TRITON_CACHE=1 brings the
# records back as $OUT/triton_autotune.tar.gz (kilobytes); unpack it into .peers/ here to carry it next time.
if [ -d .peers/site ]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.peers/triton_cache} TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
  mkdir -p "$TRITON_CACHE_DIR"
fi
[ -f third_party/cudnn_frontend/include/cudnn_frontend.h ] || echo "warning: third_party/cudnn_frontend not carried"
export PATH=/usr/local/cuda/bin:$PATH
BUILD=build-device
status=0
if has env; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; nvcc --version | tail -2;
    cmake --version | head -1; g++ --version | head -1; cat /etc/os-release | head -2; nproc; } 2>&1 | tee "$OUT/env.txt"
fi
BASE_SRC=${BASE_SRC:-.base}
if has build && [ -f "$BASE_SRC/CMakeLists.txt" ]; then
  ( cmake -S "$BASE_SRC" -B build-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTASTACK_TESTS=OFF \
        -DDS_CUDNN_FRONTEND_INCLUDE="$PWD/third_party/cudnn_frontend/include" -DPKG_CONFIG_EXECUTABLE="$PKGCONF" \
        -DCMAKE_PREFIX_PATH="$SYS/usr;$SYS/usr/lib/x86_64-linux-gnu/cmake;$SYS/usr/share/cmake" \
        -DCMAKE_CXX_FLAGS="-isystem $SYS/usr/include -isystem $SYS/usr/include/x86_64-linux-gnu" \
        -DCMAKE_CUDA_FLAGS="-isystem $SYS/usr/include" >"$OUT/configure_base.log" 2>&1 &&
    cmake --build build-base -j6 --target deltastack >"$OUT/build_base.log" 2>&1; echo "base build rc=$?" ) &
  BASE_PID=$!
fi
if has prebuilt; then
  # The binaries scripts/prebuild_device.sh packed on the development machine (carry .prebuilt): no build here.
  # Not together with `build` (that would configure and build into build-prebuilt through the link).
  [ -f .prebuilt/bin.tar.xz ] || { echo "prebuilt: .prebuilt/bin.tar.xz not carried (scripts/prebuild_device.sh)"; exit 1; }
  rm -rf build-prebuilt "$BUILD"
  tar -xJf .prebuilt/bin.tar.xz && [ -x build-prebuilt/deltastack_tests ] && ln -sfn build-prebuilt "$BUILD" ||
    { echo "prebuilt: unpacking .prebuilt/bin.tar.xz failed"; exit 1; }
  echo "prebuilt: $(head -1 .prebuilt/commit.txt 2>/dev/null || echo 'unknown commit') unpacked into build-prebuilt/"
  # An earlier commit's binary packed beside it (scripts/prebuild_device.sh BASE=<commit>): build-base/deltastack,
  # for the stages that compare against it (train, base-modes).
  if [ -f .prebuilt/base.tar.xz ]; then
    rm -rf build-base && tar -xJf .prebuilt/base.tar.xz && echo "prebuilt: base $(cat .prebuilt/base_commit.txt 2>/dev/null) in build-base/"
  fi
fi
if has base-modes && [ ! -x build-base/deltastack ]; then
  echo "base-modes: no build-base/deltastack (pack one: scripts/prebuild_device.sh with BASE_PACK, then 'prebuilt')"
  status=1
fi
if has base-modes && [ -x build-base/deltastack ]; then
  # Short training runs in the lean modes with this binary and the base binary: metrics (losses, grad norms, evals)
  # must be bitwise equal where a change claims no change of results (BASE_MODES: one set of train flags a line).
  # The --txt-split file runs pack windows of one document each (cuDNN's full length buckets, as bench step's).
  D=$BUILD/deltastack
  while read -r args; do
    [ -z "$args" ] && continue
    rm -rf /tmp/ds_bm0 /tmp/ds_bm1
    build-base/deltastack train --device cuda --steps ${BASE_STEPS:-30} --eval-interval 10 --no-save --out /tmp/ds_bm0 \
      --data "$PWD/data/tiny_shakespeare.txt" --tokenizer "$PWD/data/qwen3_tokenizer/tokenizer.json" $args \
      >/tmp/ds_bm0.txt 2>&1 || { tail -3 /tmp/ds_bm0.txt; status=1; }
    $D train --device cuda --steps ${BASE_STEPS:-30} --eval-interval 10 --no-save --out /tmp/ds_bm1 \
      --data "$PWD/data/tiny_shakespeare.txt" --tokenizer "$PWD/data/qwen3_tokenizer/tokenizer.json" $args \
      >/tmp/ds_bm1.txt 2>&1 || { tail -3 /tmp/ds_bm1.txt; status=1; }
    python3 -c "import json, sys; L=lambda p: [(j['step'], j.get('loss'), j.get('eval_loss'), j.get('grad_norm')) for j in map(json.loads, open(p))]; \
a, b = L('/tmp/ds_bm0/metrics.jsonl'), L('/tmp/ds_bm1/metrics.jsonl'); print(f'base-modes [{sys.argv[1]}]: {len(b)} lines, ' + ('bitwise identical to the base binary' if a == b and a else 'DIFFERENT')); \
raise SystemExit(0 if a == b and a else 1)" "$args" 2>&1 | tee -a "$OUT/base_modes.txt" || status=1
  done <<EOF2
${BASE_MODES:---precision fp8 --fp8-lm-head --optimizer-state 8bit --gradients in-backward --clip 0 --recompute mlp
--precision fp8 --recompute none
--precision fp8 --recompute selective --gradients fp32
--precision fp8 --recompute full
--recompute mlp
--recompute none --optimizer-state 8bit --gradients in-backward
--lora-rank 8 --precision fp8
--lora-rank 8 --recompute mlp
--txt-split file --precision fp8 --recompute mlp
--txt-split file --recompute none}
EOF2
fi
if has base-bench; then
  # bench step with earlier binaries (BASE_BENCH_BINS, default the base binary build-base/deltastack) and this one,
  # one line of flags at a time (BASE_BENCH): their step lines (time, peak, loss, grad_norm) one above the other,
  # "[BINARY ARGS]", this binary's as "[ours ARGS]". Runs before `build` in this script: use it with `prebuilt`, or
  # in a second invocation after a build.
  while read -r args; do
    [ -z "$args" ] && continue
    for bin in ${BASE_BENCH_BINS:-build-base/deltastack} $BUILD/deltastack; do
      who=$(basename "$(dirname "$bin")")/$(basename "$bin"); [ "$bin" = $BUILD/deltastack ] && who=ours
      [ -x "$bin" ] || { echo "base-bench: no $bin" | tee -a "$OUT/base_bench.txt"; status=1; continue; }
      tag="[$who $args] "
      timeout ${MEMORY_TIMEOUT:-300} $bin bench step $args </dev/null >/tmp/ds_bb.txt 2>&1
      rc=$?
      grep -E "bench step|step .* ms|rror" /tmp/ds_bb.txt | while IFS= read -r line; do printf '%s%s\n' "$tag" "$line"; done |
        tee -a "$OUT/base_bench.txt"
      [ "$rc" = 0 ] || { echo "${tag}exit status $rc" | tee -a "$OUT/base_bench.txt"; status=1; }
    done
  done <<EOF2
${BASE_BENCH:---preset 2b --seq-len 8192 --micro-batch 2 --steps 5 --recompute none}
EOF2
fi
if has build; then
  t0=$(date +%s)
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTASTACK_CUDA=${DS_CUDA:-ON} -DPKG_CONFIG_EXECUTABLE="$PKGCONF" \
        -DCMAKE_PREFIX_PATH="$SYS/usr;$SYS/usr/lib/x86_64-linux-gnu/cmake;$SYS/usr/share/cmake" \
        -DCMAKE_CXX_FLAGS="-isystem $SYS/usr/include -isystem $SYS/usr/include/x86_64-linux-gnu" \
        -DCMAKE_CUDA_FLAGS="-isystem $SYS/usr/include" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build $BUILD -j"$(nproc)" ${BUILD_TARGET:+--target $BUILD_TARGET} >"$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  echo "build: ok in $(( $(date +%s) - t0 )) s"
  [ -n "${BASE_PID:-}" ] && wait "$BASE_PID"
fi
if has test-gpu; then
  ( cd $BUILD && timeout 300 ./deltastack_tests --gtest_filter="${GPU_TEST_FILTER:-Cuda*:Cudnn*:DistNccl*:-CudaRealShapes*}" >"$OUT/tests_gpu.log" 2>&1 ) || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED)|^\[==========\]" "$OUT/tests_gpu.log" | tail -20
fi
if has test; then
  ( cd $BUILD && ./deltastack_tests >"$OUT/tests.log" 2>&1 ) || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED)" "$OUT/tests.log" | tail -12
fi
if has sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 9 $BUILD/deltastack_tests --gtest_filter="${SANITIZE_FILTER:-CudaProbeCases.*:CudaOps.*:CudaGatedDeltaRule.Packed16:CudaGatedDeltaRule.OddStrides:CudaGatedDeltaRuleChunked.PackedPartialChunks:CudaGatedDeltaRuleChunked.StrongDecayAndZeroGate:CudaLinear.ForwardBackwardRagged:CudaLinearCrossEntropy.OddVocab:CudaAttention.HeadDim64:CudnnAttention.PackedBucketsHeadDim128Gqa4}" \
      >"$OUT/memcheck.log" 2>&1; echo "memcheck rc=$? ($(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses)"
    tail -3 "$OUT/memcheck.log"
  else
    echo "compute-sanitizer: not found"
  fi
fi
if has probe; then
  $BUILD/deltastack probe 2>&1 | tee "$OUT/probe.txt"
fi
if has parity; then
  F=tests/fixtures/hf_qwen35_tiny_a
  $BUILD/deltastack forward --device cuda --model $F --inputs $F/inputs.safetensors --output /tmp/ds_gpu_out.safetensors --overwrite \
     --grads /tmp/ds_gpu_grads.safetensors && python3 scripts/compare_safetensors.py /tmp/ds_gpu_out.safetensors \
     $F/outputs.safetensors /tmp/ds_gpu_grads.safetensors $F/grads.safetensors >"$OUT/parity.txt" 2>&1 || status=1
  grep -E "^(logits|loss|worst)" "$OUT/parity.txt"
  # The same with cuDNN made unavailable: the simple attention kernel.
  DELTASTACK_CUDNN_LIBRARY=/nonexistent/libcudnn.so.9 $BUILD/deltastack forward --device cuda --model $F \
     --inputs $F/inputs.safetensors --output /tmp/ds_gpu_out2.safetensors --grads /tmp/ds_gpu_grads2.safetensors --overwrite &&
    python3 scripts/compare_safetensors.py /tmp/ds_gpu_out2.safetensors $F/outputs.safetensors \
     /tmp/ds_gpu_grads2.safetensors $F/grads.safetensors >"$OUT/parity_simple.txt" 2>&1 || status=1
  echo "(simple attention kernel:)"; grep -E "^(logits|loss|worst)" "$OUT/parity_simple.txt"
fi
if has real-shapes; then
  # Every CUDA op against the CPU reference at Qwen3.5-2B/9B layer shapes, T = 8192 and 32768 (slow: CPU refs).
  ( cd $BUILD && DELTASTACK_REAL_SHAPES=1 ./deltastack_tests --gtest_filter="${REAL_SHAPES_FILTER:-*CudaRealShapes*}" \
      >"$OUT/realshapes.log" 2>&1 ) || status=1
  grep -E "^\[  (PASSED|FAILED)|Failure" "$OUT/realshapes.log" | head -20
fi
if has bench-ops; then
  $BUILD/deltastack bench ops ${BENCH_OPS_ONLY:+--only $BENCH_OPS_ONLY} 2>&1 | tee "$OUT/bench_ops.txt"
fi
if has bench-ops-base && [ -x build-base/deltastack ]; then
  # The earlier commit's binary (.base) in the same call: an A/B for kernels changed since.
  build-base/deltastack bench ops 2>&1 | tee "$OUT/bench_ops_base.txt"
fi
if has harness || has ncu-gdn; then
  # The chunked GDN kernel's standalone harness: float64-oracle tests, per-phase timings (every scan variant).
  sh bench/build_gdn_harness.sh /tmp/gdn_h >"$OUT/harness_build.log" 2>&1 || { tail "$OUT/harness_build.log"; status=1; }
fi
if has harness; then
  timeout 300 /tmp/gdn_h ${HARNESS_MODES:-test time} 2>&1 | tee "$OUT/gdn_harness.txt" | grep -vE "^\s+(ok|pass)" | tail -40
fi
if has ncu-gdn; then
  # Hardware counters of each GDN kernel at the 2B layer shape (ncu; clocks left alone, as METHOD.md says).
  timeout 240 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats -k regex:'k_(prep|fwd_h|fwd_o|dvlocal|bwd_dh|bwd_chunk)' /tmp/gdn_h profile \
    >"$OUT/ncu_gdn.txt" 2>&1; echo "ncu rc=$?"
  grep -E "k_(prep|fwd_h|fwd_o|dvlocal|bwd_dh|bwd_chunk)|Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall" "$OUT/ncu_gdn.txt" | head -80
fi
if has ncu-conv; then
  # Hardware counters of the conv1d + SiLU kernels at bench ops' T32768 x C8192 (the 13th forward launch, after its
  # warm-up, and the first backward): ncu, clocks left alone (METHOD.md).
  timeout 300 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis \
    -k regex:'conv_(fwd|bwd)_kernel' --launch-skip 12 -c 2 $BUILD/deltastack bench ops >"$OUT/ncu_conv.txt" 2>&1
  rc=$?
  echo "ncu-conv rc=$rc"
  [ "$rc" = 0 ] || status=1
fi
if has peer; then
  # The peer's kernels at bench ops' shapes, in this same call (fla from .peers/site, carried; see peer_bench.py).
  if [ -d .peers/site/fla ]; then
    PYTHONPATH=$PWD/.peers/site python3 scripts/peer_bench.py --bypass-640 2>&1 | grep -v "Warning" | tee "$OUT/peer_bench.txt"
  else
    echo "peer: .peers/site/fla not carried"
  fi
fi
if has torch; then
  # deltastack.torch (python/, docs/torch.md): the extension built against $BUILD's kernels library (the build stage
  # first; or TORCH_KERNELS_BUILD=DIR, e.g. a carried one) by the system's g++ (the image's CXX=/opt/gcc/bin/g++
  # wrapper makes extensions that crash on any C++ exception: docs/torch.md; TORCH_BUILD=0 keeps a built one),
  # python/tests (pytest from .peers/site: scripts/fetch_peers.sh; TORCH_TESTS=0 skips them, TORCH_PYTEST_K selects),
  # then transformers' step with the strongest peer's kernels (fla and Liger from .peers/site) and patched:
  # scripts/torch_step.py at TORCH_PRESETS (default 2b; or TORCH_CONFIG=FILE, an HF config.json), TORCH_SEQ x
  # TORCH_MB, TORCH_WHICH (default all = peer,deltastack; a comma list), TORCH_TIMEOUT s each.
  TPATH=$PWD/python:$PWD/.peers/site:${PYTHONPATH:-}
  TCXX=$(command -v /usr/bin/g++ || echo "${CXX:-g++}"); TCC=$(command -v /usr/bin/gcc || echo "${CC:-gcc}")
  t0=$(date +%s)
  if [ "${TORCH_BUILD:-1}" = 0 ] && ls python/deltastack/torch/_C*.so >/dev/null 2>&1; then
    echo "torch extension: kept"
  elif ( cd python && CXX=$TCXX CC=$TCC PKG_CONFIG="$PKGCONF" \
           DELTASTACK_KERNELS_BUILD="${TORCH_KERNELS_BUILD:-$PWD/../$BUILD}" python3 setup.py build_ext --inplace ) \
         >"$OUT/torch_build.log" 2>&1; then
    echo "torch extension built by $TCXX in $(( $(date +%s) - t0 )) s: $(grep -hs 'exception check' "$OUT/torch_build.log")"
  else
    echo "torch extension: build FAILED"; tail -30 "$OUT/torch_build.log"; status=1
  fi
  if [ "${TORCH_TESTS:-1}" != 0 ]; then
    # -v names each test before it runs, so a crash still says where.
    t0=$(date +%s)
    PYTHONPATH=$TPATH timeout 1200 python3 -X faulthandler -m pytest python/tests -v -rs ${TORCH_PYTEST_K:+-k "$TORCH_PYTEST_K"} \
      >"$OUT/torch_tests.txt" 2>&1 || status=1
    grep -E "FAILED|ERROR|Fatal|passed|failed" "$OUT/torch_tests.txt" | tail -25
    echo "python tests: $(( $(date +%s) - t0 )) s"
  fi
  # One source of the config: TORCH_CONFIG, else each of TORCH_PRESETS (TORCH_PRESETS= runs no step); each run of
  # TORCH_WHICH (all = the three) gets its own process and its own TORCH_TIMEOUT. Appends: two invocations in one
  # call keep both's lines.
  runs=$(echo "${TORCH_WHICH:-all}" | sed 's/\ball\b/peer,deltastack/' | tr , ' ')
  if [ -n "${TORCH_CONFIG:-}" ]; then sources=(config); else sources=(${TORCH_PRESETS-2b}); fi
  for src in "${sources[@]}"; do
    if [ "$src" = config ]; then spec=(--config "$TORCH_CONFIG"); else spec=(--preset "$src" --deltastack "$BUILD/deltastack"); fi
    for w in $runs; do
      t0=$(date +%s)
      PYTHONPATH=$TPATH timeout "${TORCH_TIMEOUT:-1200}" python3 scripts/torch_step.py "${spec[@]}" --seq-len "${TORCH_SEQ:-8192}" \
        --micro-batch "${TORCH_MB:-2}" --which "$w" --bypass-640 2>&1 | grep -E "^torch step|^torch_step:|^peer:|^peer_step:|^step_result|Error|error:" | tee -a "$OUT/torch_step.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
      echo "torch step ${spec[*]} $w: $(( $(date +%s) - t0 )) s (rc $rc)"
    done
  done
fi
if has cpu-blas; then
  # The CPU engine's OpenBLAS kernel choice on this host's CPU (docs/cpu_engine.md, issue 14's "both kinds of CPU"):
  # the Debian 12 OpenBLAS of the sysroot, the tiny default run for CPU_BLAS_STEPS (40) steps on 2 pinned cores, with
  # the library's own pick (DELTASTACK_BLAS_CORETYPE=keep) and with deltastack's re-exec; OPENBLAS_CORETYPE unset.
  lscpu | grep -E "Model name|Vendor ID|^CPU\(s\)|Flags" | cut -c1-200 | tee "$OUT/cpu_blas.txt"
  for mode in keep reexec; do
    k=; [ "$mode" = keep ] && k=keep
    env -u OPENBLAS_CORETYPE DELTASTACK_BLAS_CORETYPE=$k $BUILD/deltastack --version | grep -i "openblas" | tee -a "$OUT/cpu_blas.txt"
    rm -rf /tmp/ds_cpu_$mode; t0=$(date +%s%N)
    env -u OPENBLAS_CORETYPE DELTASTACK_BLAS_CORETYPE=$k OMP_NUM_THREADS=2 timeout 600 taskset -c 0,1 $BUILD/deltastack \
      train --device cpu --steps "${CPU_BLAS_STEPS:-40}" --eval-interval 0 --out /tmp/ds_cpu_$mode >/tmp/ds_cpu_$mode.log 2>&1
    rc=$?; ms=$(( ($(date +%s%N) - t0) / 1000000 )); [ "$rc" = 0 ] || status=1
    echo "cpu-blas $mode: rc $rc in $ms ms; $(grep -iE "eval" /tmp/ds_cpu_$mode.log | tail -1)" | tee -a "$OUT/cpu_blas.txt"
  done
fi
# The summary of a peer stage's lines (FILE, stage name): "[ours P SxB] ... step X ms ... tokens/s ... peak G GiB" and
# "[peer P SxB ROW] step_result {...}" lines, ours / peer per run and row.
peer_summary() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
ours, peers, last = {}, {}, {}
for line in open(sys.argv[1]):
    # "[ours P SxB]" or "[ours P SxB VARIANT]" (peer-lora's LORA_PRECISIONS other than bf16): one entry each.
    m = re.match(r"\[ours (\S+ \S+)( \S+)?\]\s+step ([\d.]+) ms \(median\) \| (\d+) tokens/s .*?peak ([\d.]+) GiB", line)
    if m:
        ours.setdefault(m[1], {})[(m[2] or "").strip()] = (float(m[4]), float(m[5]))
    m = re.match(r"\[peer (\S+ \S+) (\S+)\] (.*)", line)
    if m:
        last[m[1], m[2]] = m[3].strip()
        if m[3].startswith("step_result "):
            peers[m[1], m[2]] = json.loads(m[3][len("step_result "):])
print(f"{sys.argv[2]} summary (ratios = ours / peer):")
for run, variants in ours.items():
    for v, (tok, peak) in variants.items():
        print(f"  {run}{' ' + v if v else ''}: ours {tok:.0f} tokens/s, peak {peak:.1f} GiB")
for (run, row), tail in last.items():
    r = peers.get((run, row))
    if r and r["status"] == "ok":
        used = r.get("device_used_gib")  # the peer's device footprint as ours is measured (peer_step.py)
        print(f"  {run} {row}: {r['ms_per_step']:.1f} ms/step, {r['tokens_per_s']} tokens/s, peak {r['peak_gib']:.1f} GiB"
              + (f" allocated, {used:.1f} GiB device memory in use" if used else ""))
        for v, (tok, peak) in ours.get(run, {}).items():
            print(f"    ours{' ' + v if v else ''}/peer {tok / r['tokens_per_s']:.2f}x tokens/s, {peak / r['peak_gib']:.2f}x memory"
                  + (f" ({peak / used:.2f}x its device memory in use)" if used else ""))
    elif r:
        print(f"  {run} {row}: {r['status']} ({r['peak_gib']:.1f} GiB peak)")
    else:
        print(f"  {run} {row}: no result: {tail[:200]}")
PY
}
if has peer-step; then
  # Full training steps, ours (`bench step`) against the strongest PyTorch peer (scripts/peer_step.py: transformers'
  # Qwen3.5 with fla's GDN, conv1d and gated RMSNorm and Liger's fused linear CE, RMSNorm and SwiGLU; fla and
  # liger_kernel from .peers/site, carried: scripts/fetch_peers.sh), the model config from our own binary (`plan
  # --hf-config`), so both run the same preset. PEER_RUNS: space-separated PRESET:SEQ:MB[:ROWS] (default
  # "2b:8192:2 0.8b:8192:2", or each of PEER_PRESETS at PEER_SEQ x PEER_MB); ROWS, a comma list of peer_step's rows,
  # defaults to PEER_ROWS (peer-bf16,peer-fp32master), each row its own process with PEER_TIMEOUT s (300).
  # PEER_OURS=0 skips our runs; PEER_ARGS, more peer_step.py flags. Lines: "[ours P SxB] ...", "[peer P SxB ROW] ...".
  : >"$OUT/peer_step.txt"
  runs=${PEER_RUNS:-$(for p in ${PEER_PRESETS:-2b 0.8b}; do printf '%s ' "$p:${PEER_SEQ:-8192}:${PEER_MB:-2}"; done)}
  peers=1
  for d in fla liger_kernel; do
    [ -d .peers/site/$d ] || { echo "peer-step: .peers/site/$d not carried (scripts/fetch_peers.sh)" | tee -a "$OUT/peer_step.txt"; peers=0; }
  done
  for run in $runs; do
    IFS=: read -r preset seq mb rows <<<"$run"
    tag="$preset ${seq}x$mb"
    if [ "${PEER_OURS:-1}" != 0 ]; then
      timeout ${PEER_TIMEOUT:-300} $BUILD/deltastack bench step --preset $preset --seq-len $seq --micro-batch $mb 2>&1 |
        sed "s/^/[ours $tag] /" | tee -a "$OUT/peer_step.txt"
    fi
    [ $peers = 1 ] || continue
    for row in $(echo "${rows:-${PEER_ROWS:-peer-bf16,peer-fp32master}}" | tr , ' '); do
      PYTHONPATH=$PWD/.peers/site timeout ${PEER_TIMEOUT:-300} python3 scripts/peer_step.py --preset $preset --seq-len $seq \
        --micro-batch $mb --rows $row --deltastack $BUILD/deltastack ${PEER_ARGS:-} 2>&1 | grep -v "Warning" |
        sed "s/^/[peer $tag $row] /" | tee -a "$OUT/peer_step.txt"
      rc=${PIPESTATUS[0]}
      [ "$rc" = 124 ] && echo "[peer $tag $row] timed out after ${PEER_TIMEOUT:-300} s" | tee -a "$OUT/peer_step.txt"
      [ "$rc" = 0 ] || status=1
    done
  done
  peer_summary "$OUT/peer_step.txt" peer-step
fi
if has peer-lora; then
  # LoRA training steps (issue 26, item 5), ours (`bench step --lora-rank R`: the base frozen in bf16, the adapters on
  # every linear layer) against transformers + PEFT LoRA on the same targets at the same rank, bf16 base, with fla and
  # Liger (scripts/peer_lora_step.py; peft and accelerate beside fla and liger_kernel in .peers/site, carried:
  # scripts/fetch_peers.sh), the model config from our binary. LORA_RUNS: space-separated PRESET:SEQ:MB (default
  # "9b:8192:1"; "27b:8192:1" too for the issue's second shape), LORA_RANK (16), LORA_TIMEOUT s per run (600);
  # ours once per LORA_PRECISIONS (bf16; "bf16 fp8" adds the FP8 base), LORA_ARGS more bench step flags.
  # A peer that runs out of memory is run again with --gradient-checkpointing (row peer-lora-gc; LORA_GC=0: not;
  # LORA_GC=only: with it at once).
  # LORA_MATCH_MEMORY=1: the peer runs first, and ours with --max-memory of its device memory in use (device_used_gib,
  # the measure of our own peak: context and allocator reserve included; its allocated peak where that is missing).
  # Lines: "[ours P SxB] ..." ("[ours P SxB fp8] ..." per precision past bf16), "[peer P SxB peer-lora] ...";
  # the summary gives each of ours / peer.
  : >"$OUT/peer_lora.txt"
  peers=1
  for d in fla liger_kernel peft accelerate; do
    [ -d .peers/site/$d ] || { echo "peer-lora: .peers/site/$d not carried (scripts/fetch_peers.sh)" | tee -a "$OUT/peer_lora.txt"; peers=0; }
  done
  lora_peer() {  # preset seq mb tag row [peer_lora_step flags]: one peer run; its peak (status ok) into peer_peak
    local preset=$1 seq=$2 mb=$3 tag=$4 row=$5 rc
    shift 5
    PYTHONPATH=$PWD/.peers/site timeout ${LORA_TIMEOUT:-600} python3 scripts/peer_lora_step.py --preset $preset \
      --seq-len $seq --micro-batch $mb --rank ${LORA_RANK:-16} --deltastack $BUILD/deltastack "$@" 2>&1 |
      grep -v "Warning" | sed "s/^/[peer $tag $row] /" | tee -a "$OUT/peer_lora.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "[peer $tag $row] timed out after ${LORA_TIMEOUT:-600} s" | tee -a "$OUT/peer_lora.txt"
    [ "$rc" = 0 ] || status=1
    peer_peak=$(grep -F "[peer $tag $row] step_result" "$OUT/peer_lora.txt" | tail -1 | sed 's/^[^{]*//' |
      python3 -c 'import json,sys; j=json.loads(sys.stdin.read() or "{}"); print(j.get("device_used_gib", j["peak_gib"]) if j.get("status") == "ok" else "")' 2>/dev/null)
  }
  lora_peers() {  # preset seq mb tag: the peer, and with checkpointing where it ran out of memory
    peer_peak=""
    [ $peers = 1 ] || return 0
    # LORA_GC=only: straight to checkpointing (a shape known to run out of memory without it, e.g. 27B at 8192).
    if [ "${LORA_GC:-1}" = only ]; then lora_peer "$@" peer-lora-gc --gradient-checkpointing; return 0; fi
    lora_peer "$@" peer-lora
    if [ -z "$peer_peak" ] && [ "${LORA_GC:-1}" = 1 ] &&
       grep -qF "[peer $4 peer-lora] step_result" "$OUT/peer_lora.txt" &&
       grep -F "[peer $4 peer-lora] step_result" "$OUT/peer_lora.txt" | tail -1 | grep -q '"out of memory"'; then
      lora_peer "$@" peer-lora-gc --gradient-checkpointing
    fi
  }
  for run in ${LORA_RUNS:-9b:8192:1}; do
    IFS=: read -r preset seq mb <<<"$run"
    tag="$preset ${seq}x$mb"
    match=""
    if [ "${LORA_MATCH_MEMORY:-0}" = 1 ]; then
      lora_peers $preset $seq $mb "$tag"
      [ -n "$peer_peak" ] && match="--max-memory $peer_peak"
    fi
    for prec in ${LORA_PRECISIONS:-bf16}; do
      # Tagged per precision past bf16 (the peer's), so that the summary keeps each run apart.
      otag="$tag"; [ "$prec" = bf16 ] || otag="$tag $prec"
      timeout ${LORA_TIMEOUT:-600} $BUILD/deltastack bench step --preset $preset --seq-len $seq --micro-batch $mb \
        --lora-rank ${LORA_RANK:-16} --precision $prec $match ${LORA_ARGS:-} 2>&1 | sed "s/^/[ours $otag] /" | tee -a "$OUT/peer_lora.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
    [ "${LORA_MATCH_MEMORY:-0}" = 1 ] || lora_peers $preset $seq $mb "$tag"
  done
  peer_summary "$OUT/peer_lora.txt" peer-lora
fi
if has bench-step; then
  for preset in ${BENCH_PRESETS:-2b}; do
    $BUILD/deltastack bench step --preset $preset --seq-len 8192 --micro-batch 2 2>&1 | tee -a "$OUT/bench_step.txt"
    [ "${BENCH_SIMPLE:-1}" = 1 ] && DELTASTACK_GATED_DELTA_RULE=cuda-simple $BUILD/deltastack bench step --preset $preset --seq-len 8192 --micro-batch 2 \
      2>&1 | sed 's/^/[cuda-simple] /' | tee -a "$OUT/bench_step.txt"
    [ -x build-base/deltastack ] && [ -n "${BENCH_BASE:-}" ] && build-base/deltastack bench step --preset $preset \
      --seq-len 8192 --micro-batch 2 2>&1 | sed 's/^/[base] /' | tee -a "$OUT/bench_step.txt"
    # A/B of the optimizer step overlapped with the next step (GpuModel::set_async_optimizer), in the same call.
    [ -n "${BENCH_SYNC_OPT:-}" ] && DELTASTACK_ASYNC_OPTIMIZER=0 $BUILD/deltastack bench step --preset $preset --seq-len 8192 \
      --micro-batch 2 2>&1 | sed 's/^/[optimizer in line] /' | tee -a "$OUT/bench_step.txt"
  done
fi
if has profile-step; then
  # Where the step's time goes: ms per op family / role from CUDA events, gaps, roofline (docs/gpu.md), and the
  # plain step beside it (the profile's own cost on the step time).
  for preset in ${BENCH_PRESETS:-2b}; do
    $BUILD/deltastack bench step --preset $preset --seq-len 8192 --micro-batch 2 --profile 2>&1 | tee -a "$OUT/profile_step.txt"
    $BUILD/deltastack bench step --preset $preset --seq-len 8192 --micro-batch 2 2>&1 | sed 's/^/[no profile] /' \
      | tee -a "$OUT/profile_step.txt"
  done
fi
if has memory; then
  # The memory modes at the issue's shapes: bench step reports the modes, step time and peak (plan beside it).
  # MEMORY_AB_PRIORITY=1: each run again with DELTASTACK_STREAM_PRIORITY=0 (lines "[priority 0 ARGS] ...").
  D=$BUILD/deltastack
  while read -r args; do
    [ -z "$args" ] && continue
    timeout ${MEMORY_TIMEOUT:-300} $D bench step $args --steps ${MEMORY_STEPS:-3} 2>&1 | grep -v "^\[deltastack\] attention" |
      sed "s|^|[$args] |" | tee -a "$OUT/bench_memory.txt"
    [ "${MEMORY_AB_PRIORITY:-0}" = 1 ] && DELTASTACK_STREAM_PRIORITY=0 timeout ${MEMORY_TIMEOUT:-300} $D bench step $args \
      --steps ${MEMORY_STEPS:-3} 2>&1 | grep -v "^\[deltastack\] attention" | sed "s|^|[priority 0 $args] |" |
      tee -a "$OUT/bench_memory.txt"
    # MEMORY_AB_ENV="VAR=VALUE ...": each run again with those variables (e.g. DELTASTACK_ATTENTION_SPLIT=1).
    [ -n "${MEMORY_AB_ENV:-}" ] && env ${MEMORY_AB_ENV} timeout ${MEMORY_TIMEOUT:-300} $D bench step $args \
      --steps ${MEMORY_STEPS:-3} 2>&1 | grep -v "^\[deltastack\] attention" | sed "s|^|[${MEMORY_AB_ENV} $args] |" |
      tee -a "$OUT/bench_memory.txt"
  done <<EOF2
${MEMORY_RUNS:---preset 9b --seq-len 8192 --micro-batch 1
--preset 2b --seq-len 8192 --micro-batch 2 --optimizer-state bf16 --recompute full
--preset 2b --seq-len 8192 --micro-batch 2 --optimizer-state fp32 --recompute full
--preset 2b --seq-len 8192 --micro-batch 2 --recompute none
--preset 0.8b --seq-len 8192 --micro-batch 2 --optimizer-state fp32 --recompute full
--preset 2b --seq-len 32768 --micro-batch 1 --optimizer-state bf16 --recompute full}
EOF2
fi
if has ab; then
  # A/B of environment settings on one bench step: AB_ARGS (its flags), AB_ENVS (settings separated by ";", each
  # "VAR=VALUE ..."; "-" or an empty item for none), AB_ROUNDS rounds of all of them in turn (alternating, so drift
  # falls on each), AB_STEPS timed steps each. Lines "[round R: SETTING] step ... ms ..." and each run's exit status
  # in $OUT/ab.txt.
  D=$BUILD/deltastack
  IFS=';' read -ra ab_envs <<<"${AB_ENVS:--}"
  for round in $(seq "${AB_ROUNDS:-1}"); do
    for e in "${ab_envs[@]}"; do
      read -ra vars <<<"$e"  # (splits on blanks, so " -" and "" are no settings too)
      [ "${vars[*]:-}" = "-" ] && vars=()
      for v in ${vars[@]+"${vars[@]}"}; do
        case $v in *=*) ;; *) echo "ab: AB_ENVS item \"$e\": \"$v\" is not VAR=VALUE" | tee -a "$OUT/ab.txt"; status=1; continue 2 ;; esac
      done
      label=${vars[*]:-default}
      env ${vars[@]+"${vars[@]}"} timeout ${MEMORY_TIMEOUT:-300} $D bench step ${AB_ARGS:---preset 2b} \
        --steps ${AB_STEPS:-5} >/tmp/ds_ab.txt 2>&1
      rc=$?
      grep -E "step .* ms|error|Error" /tmp/ds_ab.txt | sed "s|^|[round $round: $label] |" | tee -a "$OUT/ab.txt"
      echo "[round $round: $label] rc=$rc" | tee -a "$OUT/ab.txt"
      [ "$rc" = 0 ] || status=1
    done
  done
fi
if has curves; then
  # The lean state's loss curve against fp32's: 0.8B on the bundled text, the two runs side by side on the GPU.
  D=$BUILD/deltastack
  C="--model 0.8b --device cuda --data ${CURVE_DATA:-data/tiny_shakespeare.txt} --seq-len 1024 --micro-batch 8 --steps ${CURVE_STEPS:-300} --lr 3e-4 --warmup 30 \
     --eval-interval 25 --eval-batches 8 --recompute selective"
  rm -rf /tmp/ds_c32 /tmp/ds_c16
  $D train $C --optimizer-state fp32 --out /tmp/ds_c32 >/tmp/ds_curve32.txt 2>&1 &
  $D train $C --optimizer-state bf16 --out /tmp/ds_c16 >/tmp/ds_curve16.txt 2>&1 &
  wait
  tail -2 /tmp/ds_curve32.txt /tmp/ds_curve16.txt
  cp /tmp/ds_c32/metrics.jsonl "$OUT/curve_fp32.jsonl"; cp /tmp/ds_c16/metrics.jsonl "$OUT/curve_bf16.jsonl"
  python3 scripts/compare_curves.py "$OUT/curve_fp32.jsonl" "$OUT/curve_bf16.jsonl" | tee "$OUT/curves.txt" || status=1
fi
if has corpus; then
  # A real-text corpus larger than the runs below read (no epoch repeats): the Python sources of the transformers
  # and torch packages installed there (Apache-2.0, BSD), first CORPUS_MB (12) MB, as one .txt (paragraph documents).
  CORPUS_MB=${CORPUS_MB:-12} python3 - <<'PY'
import os, transformers, torch
limit, out, n = int(os.environ["CORPUS_MB"]) * 1_000_000, open("/tmp/ds_corpus.txt", "w"), 0
for root in (os.path.dirname(transformers.__file__), os.path.dirname(torch.__file__)):
    for d, _, fs in sorted(os.walk(root)):
        for f in sorted(fs):
            if f.endswith(".py") and n < limit:
                t = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
                out.write(t + "\n\n"); n += len(t)
print(f"corpus: {n / 1e6:.1f} MB of transformers {transformers.__version__} and torch {torch.__version__} sources in /tmp/ds_corpus.txt")
PY
fi
if has train-27b && [ ! -f /tmp/ds_corpus.txt ]; then
  echo "train-27b: no /tmp/ds_corpus.txt (run the corpus stage first)"; status=1
elif has train-27b; then
  # Qwen3.5-27B, every parameter trained with AdamW (issue 24): the modes --memory auto picks with --clip 0
  # (TRAIN27_MODES), seq TRAIN27_SEQ (8192) x 1 on the corpus. A 27B checkpoint in the 8bit state is about 101 GiB
  # (train/checkpoint.h checkpoint_bytes_estimate), more than the 64 GiB disk there, so: a 20-step reference run
  # with --no-save, a 10-step run whose checkpoint-10 goes to /dev/shm (tmpfs, 128 GiB by default; about 24 GiB of
  # RAM stays beside it), a resume from it to step 20 with --no-save, bitwise against the reference; then `export`
  # of checkpoint-10 to the disk (BF16, about 54 GB). Host peaks: /usr/bin/time -v where it exists. Logs to $OUT.
  D=$BUILD/deltastack
  # --schedule constant: the saved half stops at --steps 10 and a cosine or linear decay follows --steps, so its
  # steps 6..10 would take other learning rates than the 20-step reference's and the resume could not be bitwise.
  N="--model 27b --device cuda --data /tmp/ds_corpus.txt --seq-len ${TRAIN27_SEQ:-8192} --micro-batch 1 --lr 1e-4 \
--warmup 5 --schedule constant --val-fraction 0 --eval-batches 0 ${TRAIN27_MODES:---precision fp8 --optimizer-state 8bit --recompute full --gradients in-backward --clip 0}"
  S=/dev/shm/ds_27b
  TIME=$([ -x /usr/bin/time ] && echo "/usr/bin/time -v" || true)
  # TRAIN27_PARTS (default all four, in order): the parts to run now. One device command has 10 minutes, so the
  # parts may go in chained calls of the same warm machine (/tmp and /dev/shm stay); a part's own output is
  # removed before it runs, and everything after `export` (or with TRAIN27_CLEAN=1).
  parts=" ${TRAIN27_PARTS:-ref save resume export} "
  part() { [[ "$parts" == *" $1 "* ]]; }
  part ref && rm -rf /tmp/ds_27b_ref
  part save && rm -rf $S
  part resume && rm -rf /tmp/ds_27b_r
  part export && rm -rf /tmp/ds_27b_export
  { echo "parts:$parts"; df -h /tmp /dev/shm | tail -2; free -g | head -2; } | tee -a "$OUT/train_27b_host.txt"
  run27() {  # label, log file, command...: timed, its rc into the host log and status
    local label=$1 log=$2 t0 rc
    shift 2
    t0=$(date +%s)
    $TIME timeout 420 "$@" >"$OUT/$log" 2>&1
    rc=$?
    echo "27b $label rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train_27b_host.txt"
    [ $rc = 0 ] || status=1
  }
  part ref && run27 reference train_27b_ref.txt $D train $N --steps 20 --no-save --out /tmp/ds_27b_ref
  if part save; then
    run27 "run to the checkpoint" train_27b_saved.txt $D train $N --steps 10 --out $S
    { du -sh $S/checkpoint-10; ls -la $S/checkpoint-10; free -g | head -2; } 2>&1 | tee -a "$OUT/train_27b_host.txt"
  fi
  if part resume; then
    run27 resume train_27b_resumed.txt $D train --resume $S/checkpoint-10 --steps 20 --no-save --out /tmp/ds_27b_r
    cp /tmp/ds_27b_ref/metrics.jsonl "$OUT/metrics_27b.jsonl"
    cp /tmp/ds_27b_r/metrics.jsonl "$OUT/metrics_27b_resumed.jsonl"
    python3 - <<'PY' | tee -a "$OUT/train_27b_host.txt" || status=1
import json
L = lambda p: {j["step"]: j for j in map(json.loads, open(p)) if "loss" in j}
a, b = L("/tmp/ds_27b_ref/metrics.jsonl"), L("/tmp/ds_27b_r/metrics.jsonl")
same = sorted(b) == list(range(11, 21)) and all(a[s]["loss"] == b[s]["loss"] for s in b)
tps = sorted(a[s]["tokens_per_s"] for s in range(3, 21))[9]
print(f"27b: loss {a[1]['loss']:.4f} -> {a[20]['loss']:.4f}, median {tps:.0f} tok/s (steps 3-20), peak "
      f"{max(a[s].get('peak_gib', 0) for s in a):.1f} GiB; resume from step 10: {'bitwise identical' if same else 'DIFFERENT'}")
raise SystemExit(0 if same else 1)
PY
  fi
  if part export; then
    run27 export export_27b.txt $D export $S/checkpoint-10 /tmp/ds_27b_export
    { du -sh /tmp/ds_27b_export; ls /tmp/ds_27b_export | head; } 2>&1 | tee -a "$OUT/train_27b_host.txt"
  fi
  if part export || [ "${TRAIN27_CLEAN:-0}" = 1 ]; then rm -rf /tmp/ds_27b_ref $S /tmp/ds_27b_r /tmp/ds_27b_export; fi
fi
if has train-9b; then
  # Qwen3.5-9B on the H200 (seq 8192 x 1, the modes --memory auto picks: bf16 state): 20 steps on real text with a
  # checkpoint at step 10, then a resume from it; steps 11..20 must be bitwise equal. A 9B checkpoint is ~50 GiB and
  # the disk there 64 GiB: the step-20 saves are refused by the free-space check (exit 1) after the metrics of
  # step 20 are written. Logs go straight to $OUT.
  D=$BUILD/deltastack
  N="--model 9b --device cuda --data /tmp/ds_corpus.txt --seq-len 8192 --micro-batch 1 --lr 1e-4 --warmup 5 --val-fraction 0 --eval-batches 0"
  rm -rf /tmp/ds_9b /tmp/ds_9b_r
  df -h /tmp | tail -1
  t0=$(date +%s)
  timeout 420 $D train $N --steps 20 --save-interval 10 --out /tmp/ds_9b >"$OUT/train_9b.txt" 2>&1; echo "9b run rc=$? in $(( $(date +%s) - t0 )) s"
  cp /tmp/ds_9b/metrics.jsonl "$OUT/metrics_9b.jsonl"  # before the resume
  du -sh /tmp/ds_9b/checkpoint-10 2>&1; ls -a /tmp/ds_9b; tail -2 "$OUT/train_9b.txt"
  t0=$(date +%s)
  timeout 300 $D train --resume /tmp/ds_9b/checkpoint-10 --out /tmp/ds_9b_r >"$OUT/train_9b_resumed.txt" 2>&1; echo "9b resume rc=$? in $(( $(date +%s) - t0 )) s"
  tail -2 "$OUT/train_9b_resumed.txt"
  grep -E "gpu:|step (1|5|10|11|20) " "$OUT/train_9b.txt" "$OUT/train_9b_resumed.txt" | head -20
  cp /tmp/ds_9b_r/metrics.jsonl "$OUT/metrics_9b_resumed.jsonl"
  python3 - <<'PY' || status=1
import json
L = lambda p: {j["step"]: j for j in map(json.loads, open(p)) if "loss" in j}
a, b = L("/tmp/ds_9b/metrics.jsonl"), L("/tmp/ds_9b_r/metrics.jsonl")
same = sorted(b) == list(range(11, 21)) and all(a[s]["loss"] == b[s]["loss"] for s in b)
print(f"9b: loss {a[1]['loss']:.4f} -> {a[20]['loss']:.4f}, {a[20]['tokens_per_s']:.0f} tok/s, peak "
      f"{a[20].get('peak_gib', 0):.1f} GiB; resume from step 10: {'bitwise identical' if same else 'DIFFERENT'}")
raise SystemExit(0 if same else 1)
PY
  rm -rf /tmp/ds_9b /tmp/ds_9b_r
fi
if has train; then
  # GPU training on the embedded default: two runs with one seed must give bitwise-identical losses, and a
  # resume from the step-100 checkpoint must reproduce steps 101..200 bitwise.
  D=$BUILD/deltastack
  rm -rf /tmp/ds_g1 /tmp/ds_g2 /tmp/ds_g3
  $D train --device cuda --save-interval 100 --out /tmp/ds_g1 >/tmp/ds_train_gpu1.txt 2>&1 || { tail /tmp/ds_train_gpu1.txt; status=1; }
  $D train --device cuda --out /tmp/ds_g2 >/tmp/ds_train_gpu2.txt 2>&1 || status=1
  $D train --resume /tmp/ds_g1/checkpoint-100 --out /tmp/ds_g3 >/tmp/ds_train_gpu3.txt 2>&1 || status=1
  if [ -x build-base/deltastack ]; then  # the same run with the earlier commit's binary: losses must be bitwise equal
    rm -rf /tmp/ds_g0
    # (the earlier tree has no data/ of its own: the same bundled files, named explicitly)
    build-base/deltastack train --device cuda --out /tmp/ds_g0 --data "$PWD/data/tiny_shakespeare.txt" \
      --tokenizer "$PWD/data/qwen3_tokenizer/tokenizer.json" >/tmp/ds_train_gpu0.txt 2>&1 || { tail -3 /tmp/ds_train_gpu0.txt; status=1; }
    python3 -c "import json; L=lambda p: [(j['step'], j.get('loss'), j.get('eval_loss'), j.get('grad_norm')) for j in map(json.loads, open(p))]; \
a, b = L('/tmp/ds_g0/metrics.jsonl'), L('/tmp/ds_g1/metrics.jsonl'); print(f'vs base binary: {len(a)} lines, ' + ('bitwise identical' if a == b else 'DIFFERENT')); \
raise SystemExit(0 if a == b else 1)" || status=1
  fi
  cp /tmp/ds_g1/metrics.jsonl "$OUT/metrics_gpu.jsonl"
  python3 - <<'PY' || status=1
import json
def losses(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
def evals(p):
    return [(j["step"], j["eval_loss"]) for j in map(json.loads, open(p)) if "eval_loss" in j]
a, b, c = (losses(f"/tmp/ds_g{i}/metrics.jsonl") for i in (1, 2, 3))
same = a == b
resumed = all(a[s] == c[s] for s in c) and len(c) == 100
ev = evals("/tmp/ds_g1/metrics.jsonl")
last = [json.loads(l) for l in open("/tmp/ds_g1/metrics.jsonl") if '"loss"' in l][-1]
print(f"gpu train: {len(a)} steps, eval_loss {ev[0][1]:.4f} -> {ev[-1][1]:.4f} ({100*(1-ev[-1][1]/ev[0][1]):.1f}% lower), "
      f"{last['tokens_per_s']:.0f} tok/s, peak {last.get('peak_gib', 0):.2f} GiB, elapsed {last['elapsed_s']:.1f} s")
print(f"same seed twice: {'bitwise identical' if same else 'DIFFERENT'}; resume from step 100: "
      f"{'bitwise identical' if resumed else 'DIFFERENT'}")
raise SystemExit(0 if same and resumed else 1)
PY
  $D generate --model /tmp/ds_g1/checkpoint-200 --prompt "ROMEO:" --max-new-tokens 40 2>&1 | tail -3
  # `deltastack eval` of that checkpoint on the GPU engine and on the CPU reference: within the bf16 band.
  for dev in cuda cpu; do
    $D eval --device $dev --model /tmp/ds_g1/checkpoint-200 --data data/tiny_shakespeare.txt --seq-len 256 \
      --micro-batch 8 2>/dev/null | tail -1 >/tmp/ds_eval_$dev.json || status=1
  done
  python3 -c "import json; g, c = (json.load(open(f'/tmp/ds_eval_{d}.json'))['eval_loss'] for d in ('cuda', 'cpu')); \
print(f'eval cuda {g:.5f} cpu {c:.5f} rel {abs(g - c) / c:.2e}'); raise SystemExit(0 if abs(g - c) / c < 1e-2 else 1)" || status=1
fi
if has peft-load; then
  # Issue 26, item 3: an adapter trained by a LoRA run on the GPU, exported (`deltastack export`), loaded by PEFT
  # onto transformers' Qwen3_5ForCausalLM gives our logits. The base: the tiny preset (the fixture's size with the
  # bundled tokenizer's vocabulary, so it trains on the bundled text) at the default seed, exported as an HF directory
  # (bf16: the GPU engine's frozen base is exactly it). PEFT_STEPS (40) LoRA steps, rank 8, on the GPU; then
  # `forward --adapter` on the GPU and on the CPU on 2 x 64 tokens of the text, each against transformers + PEFT in
  # fp32 on the CPU (scripts/check_peft_load.py, peft from .peers/site): the GPU's within the bf16 band 1e-2, the
  # CPU's within 1e-4; PEFT's loaded tensors bitwise the file's. Lines in $OUT/peft_load.txt.
  D=$BUILD/deltastack; W=/tmp/ds_peft
  rm -rf $W; mkdir -p $W; : >"$OUT/peft_load.txt"
  t0=$(date +%s)
  if [ ! -d .peers/site/peft ]; then
    echo "peft-load: .peers/site/peft not carried (scripts/fetch_peers.sh)" | tee -a "$OUT/peft_load.txt"; status=1
  elif ! { $D train --device cpu --model tiny --steps 0 --eval-batches 0 --out $W/init &&
           $D export $W/init/checkpoint-0 $W/base &&
           timeout 300 $D train --device cuda --model $W/base --lora-rank 8 --lora-alpha 16 --data data/tiny_shakespeare.txt \
             --seq-len 128 --micro-batch 8 --steps ${PEFT_STEPS:-40} --lr 1e-2 --warmup 5 --eval-interval 0 --eval-batches 2 \
             --out $W/run && $D export $W/run/checkpoint-${PEFT_STEPS:-40} $W/adapter &&
           python3 scripts/check_peft_load.py --write-inputs $W/inputs.safetensors \
             --text data/tiny_shakespeare.txt --tokenizer $W/base/tokenizer.json; } >$W/log.txt 2>&1; then
    tail -5 $W/log.txt | tee -a "$OUT/peft_load.txt"; status=1
  else
    grep -E "eval_loss|done:" $W/log.txt | tail -3 | sed 's/^/[gpu lora run] /' | tee -a "$OUT/peft_load.txt"
    for dev in cuda cpu; do
      band=bf16; [ $dev = cpu ] && band=fp32
      if $D forward --device $dev --model $W/base --adapter $W/adapter --inputs $W/inputs.safetensors \
           --output $W/ours_$dev.safetensors >$W/forward_$dev.txt 2>&1; then
        PYTHONPATH=$PWD/.peers/site timeout 300 python3 scripts/check_peft_load.py $W/base $W/adapter \
          $W/inputs.safetensors $W/ours_$dev.safetensors --band $band 2>&1 | grep -vE "Warning|Loading weights|falling back" |
          sed "s/^/[forward --device $dev] /" | tee -a "$OUT/peft_load.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      else
        tail -3 $W/forward_$dev.txt | sed "s/^/[forward --device $dev] /" | tee -a "$OUT/peft_load.txt"; status=1
      fi
    done
  fi
  echo "peft-load: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/peft_load.txt"
fi
if has nccl; then
  # The NCCL data-parallel path at world size 1 (torchrun, one rank): the default GPU run's losses, eval losses
  # and grad norms bitwise (the plain run: the train stage's /tmp/ds_g2, else one made here).
  D=$BUILD/deltastack
  [ -f /tmp/ds_g2/metrics.jsonl ] || $D train --device cuda --out /tmp/ds_g2 >/tmp/ds_train_gpu2.txt 2>&1 || status=1
  for shard in none optimizer; do
    rm -rf /tmp/ds_n_$shard
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 --no-python $D train --device cuda --shard $shard \
      --out /tmp/ds_n_$shard >/tmp/ds_train_nccl_$shard.txt 2>&1 || { tail -5 /tmp/ds_train_nccl_$shard.txt; status=1; }
    grep -m1 "device:" /tmp/ds_train_nccl_$shard.txt
    python3 -c "import json, sys; L=lambda p: [(j['step'], j.get('loss'), j.get('eval_loss'), j.get('grad_norm')) for j in map(json.loads, open(p))]; \
a, b = L('/tmp/ds_g2/metrics.jsonl'), L(sys.argv[1]); print(f'nccl world 1 (torchrun, --shard {sys.argv[2]}) vs plain: {len(a)} lines, ' + ('bitwise identical' if a == b else 'DIFFERENT')); \
raise SystemExit(0 if a == b else 1)" /tmp/ds_n_$shard/metrics.jsonl $shard || status=1
    grep -E "done:" /tmp/ds_train_nccl_$shard.txt | tail -1
  done
fi
for ST in bf16 8bit; do
  has train-$ST || continue
  D=$BUILD/deltastack
  # A lean optimizer state: two runs bitwise equal, a resume from step 100 bitwise, eval loss close to fp32's.
  rm -rf /tmp/ds_${ST}_1 /tmp/ds_${ST}_2 /tmp/ds_${ST}_3
  $D train --device cuda --optimizer-state $ST --save-interval 100 --out /tmp/ds_${ST}_1 >/tmp/ds_train_${ST}_1.txt 2>&1 || { tail -3 /tmp/ds_train_${ST}_1.txt; status=1; }
  $D train --device cuda --optimizer-state $ST --out /tmp/ds_${ST}_2 >/tmp/ds_train_${ST}_2.txt 2>&1 || status=1
  $D train --resume /tmp/ds_${ST}_1/checkpoint-100 --out /tmp/ds_${ST}_3 >/tmp/ds_train_${ST}_3.txt 2>&1 || status=1
  ST=$ST python3 - <<'PY' || status=1
import json, os
st = os.environ["ST"]
def rows(p):
    return [j for j in map(json.loads, open(p))]
def losses(p):
    return {j["step"]: j["loss"] for j in rows(p) if "loss" in j}
a, b, c = (losses(f"/tmp/ds_{st}_{i}/metrics.jsonl") for i in (1, 2, 3))
ev = [j["eval_loss"] for j in rows(f"/tmp/ds_{st}_1/metrics.jsonl") if "eval_loss" in j]
ef = [j["eval_loss"] for j in rows("/tmp/ds_g1/metrics.jsonl") if "eval_loss" in j] if os.path.exists("/tmp/ds_g1/metrics.jsonl") else [float("nan")]
import collections, struct
def dtypes(f):
    h = open(f, "rb"); n = struct.unpack("<Q", h.read(8))[0]
    return collections.Counter(v["dtype"] for k, v in json.loads(h.read(n)).items() if k != "__metadata__")
print("checkpoint-100 dtypes: model", dict(dtypes(f"/tmp/ds_{st}_1/checkpoint-100/model.safetensors")), "optimizer",
      dict(dtypes(f"/tmp/ds_{st}_1/checkpoint-100/optimizer.safetensors")))
ok = a == b and all(a[s] == c[s] for s in c) and len(c) == 100
print(f"gpu train, --optimizer-state {st}: eval_loss {ev[0]:.4f} -> {ev[-1]:.4f} (fp32 state: {ef[-1]:.4f}, "
      f"{100 * (ev[-1] / ef[-1] - 1):+.2f}%); same seed twice and resume from step 100: "
      f"{'bitwise identical' if ok else 'DIFFERENT'}")
raise SystemExit(0 if ok else 1)
PY
done
if has fp8; then
  # --precision fp8 against bf16 (docs/fp8.md): bench step at FP8_RUNS (each line run in bf16 and in fp8, same call).
  D=$BUILD/deltastack
  while read -r args; do
    [ -z "$args" ] && continue
    for prec in ${FP8_PRECISIONS:-bf16 fp8}; do
      timeout 300 $D bench step $args --precision $prec ${FP8_PROFILE:+--profile} 2>&1 | grep -vE "^\[deltastack\] (attention|gpu: --precision)" \
        | sed "s|^|[$prec $args] |" | tee -a "$OUT/bench_fp8.txt"
    done
  done <<EOF2
${FP8_RUNS:---preset 2b --seq-len 8192 --micro-batch 2
--preset 9b --seq-len 8192 --micro-batch 1
--preset 0.8b --seq-len 8192 --micro-batch 2}
EOF2
fi
if has fp8-ab; then
  # The FP8 casts' amax without extra passes (docs/fp8.md) against an amax pass before every cast: bench step
  # --precision fp8 at FP8_AB_RUNS (one line of bench step flags each) with DELTASTACK_FP8_AMAX=separate, then fused
  # (the default), same call; FP8_AB_PROFILE=1 adds --profile to both (per-family A/B).
  D=$BUILD/deltastack
  while read -r args; do
    [ -z "$args" ] && continue
    for mode in separate fused; do
      DELTASTACK_FP8_AMAX=$mode timeout 300 $D bench step $args --precision fp8 ${FP8_AB_PROFILE:+--profile} 2>&1 |
        grep -vE "^\[deltastack\] attention" | sed "s|^|[amax $mode $args] |" | tee -a "$OUT/bench_fp8_ab.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
  done <<EOF2
${FP8_AB_RUNS:---preset 2b --seq-len 8192 --micro-batch 2
--preset 9b --seq-len 8192 --micro-batch 1}
EOF2
fi
if has curves-fp8; then
  # FP8 against bf16 on real text (the corpus stage's /tmp/ds_corpus.txt, no epoch repeats at these sizes): every
  # run of CURVE_RUNS (MODEL:SEQ:MB) in bf16 and in fp8 with one seed, data and schedule, all side by side on the GPU
  # (CURVE_TIMEOUT s at most each: a run stopped early keeps the metrics it wrote); metrics to $OUT.
  D=$BUILD/deltastack
  [ -f /tmp/ds_corpus.txt ] || { echo "curves-fp8: no /tmp/ds_corpus.txt (run the corpus stage first)"; status=1; }
  t0=$(date +%s)
  for spec in ${CURVE_RUNS:-0.8b:1024:4}; do
    IFS=: read -r model seq mb <<<"$spec"
    for prec in bf16 fp8; do
      rm -rf /tmp/ds_f_${model}_$prec
      timeout ${CURVE_TIMEOUT:-600} $D train --model $model --device cuda --data /tmp/ds_corpus.txt --seq-len $seq \
        --micro-batch $mb --steps ${CURVE_STEPS:-1000} --lr ${CURVE_LR:-3e-4} --warmup 50 --eval-interval 100 \
        --eval-batches 16 --val-fraction 0.005 --optimizer-state fp32 --recompute selective --precision $prec \
        --out /tmp/ds_f_${model}_$prec >/tmp/ds_f_${model}_$prec.txt 2>&1 &
    done
  done
  wait
  echo "curves-fp8: $(( $(date +%s) - t0 )) s"
  for spec in ${CURVE_RUNS:-0.8b:1024:4}; do
    model=${spec%%:*}
    for prec in bf16 fp8; do
      tail -1 /tmp/ds_f_${model}_$prec.txt
      cp /tmp/ds_f_${model}_$prec/metrics.jsonl "$OUT/curve_fp8_${model}_$prec.jsonl" || status=1
    done
    echo "== $spec: fp8 against bf16" | tee -a "$OUT/curves_fp8.txt"
    python3 scripts/compare_curves.py "$OUT/curve_fp8_${model}_bf16.jsonl" "$OUT/curve_fp8_${model}_fp8.jsonl" --band 0.005 --after 100 \
      | tee -a "$OUT/curves_fp8.txt" || status=1
  done
fi
if has curves-modes; then
  # Each mode against the exact one on real text (the corpus stage's /tmp/ds_corpus.txt), all runs side by side on
  # the GPU with one seed, data and schedule: CURVE_SPECS, space-separated
  # MODEL:SEQ:MB:PRECISION:STATE[:GRADIENTS[:ACCUM]] (PRECISION: bf16, fp8, or fp8head for fp8 with --fp8-lm-head; GRADIENTS: --gradients, fp32 when empty, e.g. bf16;
  # ACCUM: --grad-accum, 1 when empty; give the reference the same ACCUM) (the first spec of each model is its
  # reference, compared with scripts/compare_curves.py to every other one of that model, within CURVE_BAND, 0.005); CURVE_STEPS (1000), CURVE_TIMEOUT s at most per run (a run stopped
  # early keeps the metrics it wrote); metrics to $OUT/curve_<model>_<precision>_<state>[_<gradients>][_x<accum>].jsonl.
  D=$BUILD/deltastack
  [ -f /tmp/ds_corpus.txt ] || { echo "curves-modes: no /tmp/ds_corpus.txt (run the corpus stage first)"; status=1; }
  t0=$(date +%s)
  specs=${CURVE_SPECS:-"0.8b:1024:4:bf16:fp32 0.8b:1024:4:fp8:fp32 0.8b:1024:4:bf16:8bit"}
  for spec in $specs; do
    IFS=: read -r model seq mb prec st grads accum <<<"$spec"
    tag=${model}_${prec}_${st}${grads:+_$grads}${accum:+_x$accum}
    rm -rf /tmp/ds_m_$tag
    timeout ${CURVE_TIMEOUT:-600} $D train --model $model --device cuda --data /tmp/ds_corpus.txt --seq-len $seq \
      --micro-batch $mb --steps ${CURVE_STEPS:-1000} --lr ${CURVE_LR:-3e-4} --warmup 50 --eval-interval 100 \
      --eval-batches 16 --val-fraction 0.005 --optimizer-state $st --recompute selective \
      $( [ "$prec" = fp8head ] && echo "--precision fp8 --fp8-lm-head" || echo "--precision $prec") \
      --gradients ${grads:-fp32} --grad-accum ${accum:-1} --out /tmp/ds_m_$tag >/tmp/ds_m_$tag.txt 2>&1 &
  done
  wait
  echo "curves-modes: $(( $(date +%s) - t0 )) s"
  declare -A ref
  for spec in $specs; do
    IFS=: read -r model seq mb prec st grads accum <<<"$spec"
    tag=${model}_${prec}_${st}${grads:+_$grads}${accum:+_x$accum}
    tail -2 /tmp/ds_m_$tag.txt
    cp /tmp/ds_m_$tag/metrics.jsonl "$OUT/curve_$tag.jsonl" || { status=1; continue; }
    if [ -z "${ref[$model]:-}" ]; then ref[$model]=$tag; continue; fi
    echo "== $model: $tag against ${ref[$model]}" | tee -a "$OUT/curves_modes.txt"
    python3 scripts/compare_curves.py "$OUT/curve_${ref[$model]}.jsonl" "$OUT/curve_$tag.jsonl" --band ${CURVE_BAND:-0.005} \
      --after 100 | tee -a "$OUT/curves_modes.txt" || status=1
  done
fi
if has ncu-step; then
  # Every kernel of a 2B training step (seq 8192 x 2: one warm-up step + one timed) with its duration, for the
  # per-kernel breakdown (ncu serialises kernels; one metric, one replay each).
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $BUILD/deltastack bench step --preset ${NCU_PRESET:-2b} --steps 1 >"$OUT/ncu_step.csv" 2>"$OUT/ncu_step.err"
  echo "ncu-step rc=$? ($(grep -c gpu__time_duration "$OUT/ncu_step.csv") kernel launches)"
fi
if [ "${PEER_TRITON_CACHE:-0}" = 1 ] && [ -d "${TRITON_CACHE_DIR:-}" ]; then
  # Only the autotune records (<hash>/<kernel>.autotune.json), under triton_cache/ as .peers/ holds them.
  ( cd "$(dirname "$TRITON_CACHE_DIR")" && find "$(basename "$TRITON_CACHE_DIR")" -name '*.autotune.json' -print0 |
      tar -czf "$OUT/triton_autotune.tar.gz" --null -T - ) &&
    echo "triton: $(tar -tzf "$OUT/triton_autotune.tar.gz" | grep -c autotune) autotune records in $OUT/triton_autotune.tar.gz"
fi
exit $status
