#!/usr/bin/env bash
# docs/performance.md's GPU strategy table and profiles (and, with --with-paper-shape, the
# paper's shape) in one command, from the repository's root on a machine with one CUDA GPU
# (pepo installed, or src/ on PYTHONPATH):
#
#     bash benchmarks/gpu_figures.sh [OUT]                       # on one CUDA GPU
#     bash benchmarks/gpu_figures.sh OUT --with-paper-shape      # and the paper's shape
#     bash benchmarks/gpu_figures.sh OUT --quick                 # that it runs, on a CPU
#
# In this order, each step's output in OUT (default gpu_figures/) as it goes:
# 1. the Triton kernels' tests on the GPU (kernel_tests.txt);
# 2. the strategies' table, three back-to-back rounds, with global_topk's threshold by a sort
#    (the default) and by a radix select (PEPO_TOPK_SELECT=radix): weighting_sort.md/.json,
#    weighting_radix.md/.json;
# 3. where the windowed strategies', global_topk's and gtpo's GPU time goes (profile.md);
# 4. with --with-paper-shape, Qwen3-1.7B's GRPO and PEPO steps (paper_shape.md/.json).
# A step that fails is reported and the next one runs.
set -uo pipefail

out=gpu_figures
quick=0
paper=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --with-paper-shape) paper=1 ;;
    -*) echo "unknown option $arg (expected --quick or --with-paper-shape)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=()

step() {  # step NAME LOGFILE COMMAND...: run it, tee its output, note a failure
  local name=$1 log=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S) UTC)"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "== $name failed (exit $rc)"
    failed+=("$name")
  fi
}

python -c "import torch, platform; print('torch', torch.__version__, '| python',
platform.python_version(), '|', torch.cuda.get_device_name() if torch.cuda.is_available()
else 'no CUDA device')" | tee "$out/machine.txt"

if [ "$quick" -eq 1 ]; then
  if python -c "import torch, triton" 2>/dev/null; then
    step "kernel tests (interpreter, a sample)" "$out/kernel_tests.txt" \
      env TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider -x \
      tests/test_triton_kernels.py -k "entropy_bonus"
  else
    echo "== kernel tests skipped: torch with Triton does not import" | tee "$out/kernel_tests.txt"
  fi
  weighting=(--quick --sync-table --only weighting)
  profile=(--quick --profile-only --profile global_topk)
else
  step "kernel tests" "$out/kernel_tests.txt" \
    python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_topk.py
  weighting=(--device cuda --only weighting --no-memory --rounds 3)
  profile=(--profile-only --profile proximal_softmax window_average global_topk gtpo)
fi
for select in sort radix; do
  step "strategies, global_topk by $select" "$out/weighting_$select.md" \
    env PEPO_TOPK_SELECT=$select PEPO_BENCH_JSON="$out/weighting_$select.json" \
    python benchmarks/bench_weighting.py "${weighting[@]}"
done
step "profiles" "$out/profile.md" \
  python benchmarks/bench_weighting_variants.py "${profile[@]}" --out "$out/profile.json"
if [ "$paper" -eq 1 ] && [ "$quick" -eq 1 ]; then
  step "the paper's shape" "$out/paper_shape.md" \
    python benchmarks/bench_paper_shape.py --tiny --out "$out/paper_shape.json"
elif [ "$paper" -eq 1 ]; then
  step "the paper's shape" "$out/paper_shape.md" \
    python benchmarks/bench_paper_shape.py --out "$out/paper_shape.json"
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf -v joined '%s; ' "${failed[@]}"
  echo "failed: ${joined%; } (see their logs in $out/)"
  exit 1
fi
echo "done: $out/"
