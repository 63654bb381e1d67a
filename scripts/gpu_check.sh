#!/usr/bin/env bash
# One device call: set up, build the factors (unless already built and carried), run the GPU
# tests, the main job on every model, and the benchmarks. Logs go to $OUT (or ./gpu_out).
#
#   bash scripts/gpu_check.sh [STAGE ...]    stages: setup build list tests selftest run bench bench_rn
#                                            host gap tune ep sanitize (default: all but host, gap,
#                                            tune, ep and sanitize, in that order; sanitize: the GPU
#                                            tests of the factors under compute-sanitizer's memcheck,
#                                            racecheck, synccheck and initcheck, each first shown a
#                                            planted fault, scripts/gpu_sanitize.py; host:
#                                            benchmarks/host_moe.py, the host
#                                            time of one eager call by stage; gap: each kernel of the
#                                            T >= 4096 calls against the card's matmul, copy and
#                                            write rates, scripts/kernel_times_moe.py then
#                                            benchmarks/gap_moe.py, and cuBLAS and
#                                            torch._grouped_mm at the same GEMM shapes,
#                                            benchmarks/gemm_shape_rate.py; ep: every GPU)
# On a GPU machine without cffi and without a package index (such as the project's lent H200):
# bring .whl/ (the wheels of cffi and pycparser for its Python, e.g. cp312), which setup installs,
# and, to skip the build there, the factors/*.so built elsewhere.
#
# Environment variables (all optional):
#   OUT               folder of the logs and result files (default: gpu_out/ in the repository root)
#   SELFTEST_ARGS     arguments of each scripts/gpu_*_selftest.py (e.g. --quick --no-timing)
#   BENCH_ARGS        arguments of benchmarks/bench_moe.py (e.g. --models qwen3-30b-a3b --skew);
#                     its --json is always $OUT/bench_moe.json
#   TUNE_ARGS         arguments of benchmarks/tune_moe.py, whose --out is always $OUT/tuning.yaml
#                     (where none is there yet, a copy of this GPU's shipped table if there is
#                     one, e.g. manifests/tuning/h200.yaml on the H200; else a new table)
#                     (with --follow-gaps M, keep M a few rows' time under TUNE_TIMEOUT / 60: a
#                     tuner stopped by the timeout writes no file)
#   SANITIZE_ARGS     arguments of scripts/gpu_sanitize.py (e.g. --tools memcheck --timeout 300;
#                     its --out is always $OUT; its logs: $OUT/sanitize_<tool>.txt)
#   GAP_CASES         model:T cases of the gap stage (default: every model at T = 4096 and 16384;
#                     gemm_shape_rate.py takes their models and their T, every pairing of them)
#   TESTS_TIMEOUT (450: the suite took 282 s on an H100 before test_gpu_configs.py's 200 cases),
#   SELFTEST_TIMEOUT (150, each self-test), RUN_TIMEOUT (300), BENCH_TIMEOUT (500: bench,
#   bench_rn, host, and each of the gap stage's two tools), TUNE_TIMEOUT (400), EP_TIMEOUT (300,
#   each torchrun): seconds before a stage's command is stopped (a stopped stage fails)
# Exit status: 0 every stage passed; 1 a stage failed (a self-test that tested nothing, or GPU
# tests that all skipped, fail too; setup finding no CUDA device stops the script at once, with
# a line "no CUDA device ...", where a later stage needs one: tests selftest run bench bench_rn
# host gap tune ep sanitize); 2 an unknown stage, a log folder (OUT) that cannot be written, or carried
# wheels that do not install.
set -u -o pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
stages=${*:-setup build list tests selftest run bench bench_rn}
has() { [[ " $stages " == *" $1 "* ]]; }
for s in $stages; do
  case " setup build list tests selftest run bench bench_rn host gap tune ep sanitize " in
    *" $s "*) ;;
    *) echo "gpu_check.sh: unknown stage '$s'; expected some of: setup build list tests selftest run bench bench_rn host gap tune ep sanitize" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$PWD/gpu_out}
# a log folder that cannot be made or written stops here, before any stage spends device time
# whose logs and JSON would be lost (OUT=/proc/x ran every stage, tee failing on each)
if ! mkdir -p "$OUT" 2>/dev/null || ! [ -w "$OUT" ] || ! : > "$OUT/.gpu_check_write_test" 2>/dev/null; then
  echo "gpu_check.sh: OUT: cannot write the log folder '$OUT'; expected a writable folder (set OUT)" >&2
  exit 2
fi
rm -f "$OUT/.gpu_check_write_test"
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

if has setup || has tests || has run || has bench || has bench_rn || has host || has gap || has list || has tune || has ep || has sanitize; then
  if ! python3 -c "import cffi" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "cannot install carried wheels from .whl/"; exit 2; }
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  export PYTHONUNBUFFERED=1
fi
if has setup; then
  step setup
  # a device check on a machine without the device, the toolkit or CuPy has checked nothing: fail
  smi=0
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv || { status=1; smi=1; }
  nvcc --version | tail -1; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # exit status 3: CuPy imports but sees no CUDA device (1: an import failed)
  python3 -c "import sys
try:
    import cupy, numpy, yaml, ml_dtypes, cffi
except ImportError as exc:   # one line, not a traceback: which module this Python cannot import
    first = (str(exc).strip().splitlines() or [''])[0]
    if isinstance(exc, ModuleNotFoundError) and exc.name and '.' not in exc.name:
        print(f'gpu_check.sh: setup: {exc.name} is not installed for', sys.executable, file=sys.stderr)
    else:   # installed but broken (CuPy: 'CuPy is not correctly installed', a numpy extension)
        print(f'gpu_check.sh: setup: an import failed for {sys.executable}: {first}', file=sys.stderr)
    sys.exit(1)
print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cffi', cffi.__version__)
try:
    n = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    n, why = 0, f'{type(exc).__name__}: {exc}'
else:
    why = 'cupy.cuda.runtime.getDeviceCount() = 0'
if n < 1:
    print('no CUDA device:', why, file=sys.stderr)
    sys.exit(3)"
  py=$?
  [ "$py" = 0 ] || status=1
  # no device (CuPy sees none, or, where CuPy does not import, nvidia-smi fails): the GPU stages
  # would run on the CPU or fail one by one (a CPU machine ran pytest and run moe --model all)
  if [ "$py" = 3 ] || { [ "$py" != 0 ] && [ "$smi" != 0 ]; }; then
    gpu_stages=""
    for s in tests selftest run bench bench_rn host gap tune ep sanitize; do has "$s" && gpu_stages="$gpu_stages $s"; done
    if [ -n "$gpu_stages" ]; then
      echo "gpu_check.sh: no CUDA device (setup's device check failed, above): stopping before the stages that need one:$gpu_stages" >&2
      exit 1
    fi
  fi
fi
if has build; then
  step build
  make -j"$(nproc)" NVCC_THREADS=2 2>&1 | tee "$OUT/build.log" || status=1
fi
if has list; then
  step list-factors
  python3 -m ex_engine list-factors 2>&1 | tee "$OUT/list_factors.txt" || status=1
fi
if has tests; then
  step GPU tests
  timeout ${TESTS_TIMEOUT:-450} python3 -m pytest -q -m gpu tests/ -rf --maxfail=20 --durations=5 2>&1 | tee "$OUT/gpu_tests.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # every GPU test skipped (no GPU, no CuPy) is no pass
  grep -Eq "[1-9][0-9]* passed" "$OUT/gpu_tests.log" || { echo "gpu_check.sh: no GPU test ran"; status=1; }
fi
if has selftest; then
  for s in scripts/gpu_*_selftest.py; do
    [ -f "$s" ] || continue
    step "$s"
    timeout ${SELFTEST_TIMEOUT:-150} python3 "$s" ${SELFTEST_ARGS:-} 2>&1 | tee "$OUT/$(basename "$s" .py).log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has run; then
  step "run moe on every model"
  timeout ${RUN_TIMEOUT:-300} python3 -m ex_engine run moe --model all --tokens 1 64 4096 2>&1 | tee "$OUT/run_moe.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has bench && [ -f benchmarks/bench_moe.py ]; then
  step benchmark
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/bench_moe.py ${BENCH_ARGS:-} --json "$OUT/bench_moe.json" 2>&1 | tee "$OUT/bench_moe.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has bench_rn; then
  step "router/norm benchmark"
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/bench_router_norm.py --json "$OUT/bench_router_norm.json" 2>&1 | tee "$OUT/bench_router_norm.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has host; then
  step "host time of one eager moe_fused_gemm call, by stage"
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/host_moe.py --models qwen3-30b-a3b granite-3.0-3b-a800m mixtral-8x7b --json "$OUT/host_moe.json" 2>&1 | tee "$OUT/host_moe.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has gap; then
  step "each kernel of the T >= 4096 calls against the card's rates (kernel_times_moe.py, gap_moe.py)"
  gap_cases=${GAP_CASES:-$(for m in deepseek-v2-lite granite-3.0-3b-a800m mixtral-8x7b olmoe-1b-7b phi-3.5-moe qwen3-235b-a22b qwen3-30b-a3b; do echo "$m:4096 $m:16384"; done)}
  # (word splitting of gap_cases is meant: one argument per case)
  timeout ${BENCH_TIMEOUT:-500} python3 scripts/kernel_times_moe.py --graph --ceilings --calls 4 --json "$OUT/kernel_times_gap.json" --cases $gap_cases 2>&1 | tee "$OUT/kernel_times_gap.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # the cases timed before a stop are in the JSON too (written after every case)
  if [ -f "$OUT/kernel_times_gap.json" ]; then
    python3 benchmarks/gap_moe.py "$OUT/kernel_times_gap.json" 2>&1 | tee "$OUT/gap_moe.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  step "cuBLAS and torch._grouped_mm at the same GEMM shapes (gemm_shape_rate.py)"
  gap_models=$(for c in $gap_cases; do echo "${c%%:*}"; done | sort -u)
  gap_tokens=$(for c in $gap_cases; do echo "${c##*:}"; done | sort -un)
  # (word splitting meant, as above)
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/gemm_shape_rate.py --models $gap_models --tokens $gap_tokens --json "$OUT/gemm_shape_rate.json" 2>&1 | tee "$OUT/gemm_shape_rate.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has tune; then
  step "tune moe_fused_gemm tile configurations (writes $OUT/tuning.yaml; copy it to manifests/tuning/)"
  # start from this GPU's shipped table where there is one (tune_moe.py merges into --out, keeping
  # the rows it does not re-tune, and refuses another GPU's file); else tune_moe.py starts a new one
  shipped=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import torch, tune_moe
p = torch.cuda.get_device_properties(0); print(tune_moe.default_out(p.name, p.multi_processor_count))' 2>/dev/null)
  if [ ! -f "$OUT/tuning.yaml" ] && [ -n "$shipped" ] && [ -f "$shipped" ]; then cp "$shipped" "$OUT/tuning.yaml"; fi
  timeout ${TUNE_TIMEOUT:-400} python3 benchmarks/tune_moe.py ${TUNE_ARGS:-} --out "$OUT/tuning.yaml" 2>&1 | tee "$OUT/tune_moe.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has ep; then
  step "expert parallelism over NCCL: check and benchmark on 1..$(nvidia-smi -L | wc -l) GPUs"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(nvidia-smi -L | wc -l)
  timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$ngpu" examples/ep_moe.py --check 2>&1 | tee "$OUT/ep_check.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  for n in $(seq 1 "$ngpu"); do
    timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$n" examples/ep_moe.py --bench --json "$OUT/ep_bench_$n.json" 2>&1 | tee "$OUT/ep_bench_$n.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has sanitize; then
  step "GPU tests under compute-sanitizer (scripts/gpu_sanitize.py; logs: $OUT/sanitize_<tool>.txt)"
  # (word splitting of SANITIZE_ARGS is meant: one argument per word)
  python3 scripts/gpu_sanitize.py ${SANITIZE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/sanitize.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
step "done: status $status"
exit $status
