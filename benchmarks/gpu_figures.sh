#!/usr/bin/env bash
# docs/performance.md's GPU strategy table and profiles (and, with --with-paper-shape, the
# paper's shape) in one command, from the repository's root on a machine with one CUDA GPU
# (pepo installed, or src/ on PYTHONPATH):
#
#     bash benchmarks/gpu_figures.sh [OUT]                       # on one CUDA GPU
#     bash benchmarks/gpu_figures.sh OUT --with-paper-shape      # and the paper's shape
#     bash benchmarks/gpu_figures.sh OUT --with-recipe           # and the recipe on CUDA
#     bash benchmarks/gpu_figures.sh OUT --quick                 # that it runs, on a CPU
#
# In this order, each step's output in OUT (default gpu_figures/) as it goes:
# 1. the machine (torch, Triton, Python, the GPU, its driver and memory) and the Triton kernels'
#    tests on the GPU (kernel_tests.txt);
# 2. the strategies' table, three back-to-back rounds, with global_topk's threshold by a sort
#    (PEPO_TOPK_SELECT=sort), by a radix select (the default) and, on a GPU, by one with two
#    12-bit passes (radix12): weighting_sort.md/.json, weighting_radix.md/.json,
#    weighting_radix12.md/.json; the radix log ends with global_topk on 2^25 tokens, checked
#    against the exact count;
# 3. where the windowed strategies', global_topk's and gtpo's GPU time goes (profile.md);
# 4. with --with-paper-shape, Qwen3-1.7B's GRPO and PEPO steps (paper_shape.md/.json);
# 5. with --with-recipe, the training layer's CUDA-only tests and `tiny` for 10 steps on CUDA
#    (recipe_cuda.log; recipes/ on PYTHONPATH, or pepo installed with its recipe extra): what
#    a test suite on CPUs cannot see.
# A step that fails, or runs past its time limit, is reported and the next one runs. Nine
# files in all on a GPU, seven with --quick (two more with the paper's shape, one with the
# recipe); the steps' time limits add up to about 12 minutes without the paper's shape or the
# recipe (an H200 took about 2.5 minutes for all of it with the recipe). A strategy whose output differs from its direct formulation, or whose kernel fails,
# is a row saying so (not a timing of a fallback).
set -uo pipefail

out=gpu_figures
quick=0
paper=0
recipe=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --with-paper-shape) paper=1 ;;
    --with-recipe) recipe=1 ;;
    -*) echo "unknown option $arg (expected --quick, --with-paper-shape or --with-recipe)" >&2
        exit 2 ;;
    *) out=$arg ;;
  esac
done
mkdir -p "$out"
rm -f "$out"/kernel_tests.txt "$out"/weighting_*.md "$out"/weighting_*.json "$out"/profile.* \
  "$out"/paper_shape.* "$out"/recipe_cuda.log  # the logs below are appended to
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

step() {  # step NAME SECONDS LOGFILE COMMAND...: run it within SECONDS, tee its output (appended)
  local name=$1 limit=$2 log=$3
  shift 3
  echo "== $name ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then
    echo "== $name stopped after its ${limit} s" | tee -a "$log"
    failed+=("$name (time)")
  elif [ "$rc" -ne 0 ]; then
    echo "== $name failed (exit $rc)" | tee -a "$log"
    failed+=("$name")
  fi
}

$PY -c "import torch, platform; print('torch', torch.__version__, '| python',
platform.python_version(), '|', torch.cuda.get_device_name() if torch.cuda.is_available()
else 'no CUDA device')" 2>&1 | tee -a "$out/kernel_tests.txt"
$PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$out/kernel_tests.txt"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
    | tee -a "$out/kernel_tests.txt"
fi

if [ "$quick" -eq 1 ]; then
  if $PY -c "import torch, triton" 2>/dev/null; then
    step "kernel tests (interpreter, a sample)" 300 "$out/kernel_tests.txt" \
      env TRITON_INTERPRET=1 $PY -m pytest -q -p no:cacheprovider -x \
      tests/test_triton_kernels.py -k "entropy_bonus"
  else
    echo "== kernel tests skipped: torch with Triton does not import" \
      | tee -a "$out/kernel_tests.txt"
  fi
  weighting=(--quick --sync-table --only weighting)
  profile=(--quick --profile-only --profile global_topk "global_topk(proximal)")
else
  step "kernel tests" 120 "$out/kernel_tests.txt" \
    $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_topk.py
  weighting=(--device cuda --only weighting --no-memory --rounds 3)
  profile=(--profile-only --profile proximal_softmax window_average global_topk \
    "global_topk(proximal)" gtpo)
fi
selects=(sort radix)
[ "$quick" -eq 0 ] && selects+=(radix12)  # on a CPU the table has no kernels: the same run
for select in "${selects[@]}"; do
  step "strategies, global_topk by $select" 150 "$out/weighting_$select.md" \
    env PEPO_TOPK_SELECT=$select PEPO_BENCH_JSON="$out/weighting_$select.json" \
    $PY benchmarks/bench_weighting.py "${weighting[@]}"
done
if [ "$quick" -eq 0 ]; then
  step "global_topk on 2^25 tokens, radix" 40 "$out/weighting_radix.md" \
    env PEPO_TOPK_SELECT=radix $PY benchmarks/bench_weighting.py --device cuda --only topk
fi
step "profiles" 120 "$out/profile.md" \
  $PY benchmarks/bench_weighting_variants.py "${profile[@]}" --out "$out/profile.json"
if [ "$paper" -eq 1 ] && [ "$quick" -eq 1 ]; then
  step "the paper's shape" 300 "$out/paper_shape.md" \
    $PY benchmarks/bench_paper_shape.py --tiny --out "$out/paper_shape.json"
elif [ "$paper" -eq 1 ]; then
  step "the paper's shape" 600 "$out/paper_shape.md" \
    $PY benchmarks/bench_paper_shape.py --out "$out/paper_shape.json"
fi
if [ "$recipe" -eq 1 ]; then
  run_dir=$(mktemp -d)  # the run's checkpoints stay behind; its summary is printed
  if [ "$quick" -eq 1 ]; then device=cpu; steps=2; else device=cuda; steps=10; fi
  if [ "$quick" -eq 0 ]; then
    step "the training layer's CUDA-only tests" 120 "$out/recipe_cuda.log" \
      $PY -m pytest -q -p no:cacheprovider tests/training/test_step.py -k cuda
  fi
  step "tiny, $steps steps on $device" 240 "$out/recipe_cuda.log" \
    $PY -m pepo_recipe --config recipes/configs/tiny.yaml device=$device num_steps=$steps \
    output_dir="$run_dir/tiny"
  cat "$run_dir/tiny/summary.json" >> "$out/recipe_cuda.log" 2>/dev/null
  rm -rf "$run_dir"
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf -v joined '%s; ' "${failed[@]}"
  echo "failed: ${joined%; } (see their logs in $out/)"
  exit 1
fi
echo "done: $out/"
