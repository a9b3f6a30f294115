#!/usr/bin/env bash
# The checks that need a GPU, in one run: the engine and cache tests on CUDA (EngineConfig's device "auto"
# picks it), then the GPU benchmarks. For a machine with python3, torch + CUDA and no network; packages
# it lacks are installed from the wheels in .whl/ when that folder is there.
#
#   bash bench/gpu_checks.sh OUT_DIR
#
# Writes OUT_DIR/gpu_checks.log (every step's output) and each benchmark's JSON.
set -u
OUT=${1:?usage: bash bench/gpu_checks.sh OUT_DIR}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee -a "$LOG"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its output in the log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
}

# Each step has a time limit; GPU_CHECKS picks steps (default: all but cache_shift),
# e.g. GPU_CHECKS="tests cache_policy".
want() { [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" $1 "* ]]; }
want tests && step tests 150 python3 -m pytest -q -rfE -p no:cacheprovider -o addopts="" tests/engines/native tests/residency \
  tests/test_lora_format.py tests/sim/test_engine_agreement.py
want lora_ops && step lora_ops 60 python3 bench/lora_ops.py --device cuda --quick --json "$OUT/lora_ops.cuda.quick.json"
want engine_throughput && step engine_throughput 90 python3 bench/engine_throughput.py --device cuda --quick \
  --cache-dir /tmp/loraplex-bench --json "$OUT/engine_throughput.cuda.quick.json"
want engine_overhead && step engine_overhead 120 python3 bench/engine_overhead.py --device cuda --quick \
  --cache-dir /tmp/loraplex-bench --json "$OUT/engine_overhead.cuda.quick.json"
want adapter_load && step adapter_load 120 python3 bench/adapter_load.py --device cuda --repeats 3 \
  --json "$OUT/adapter_load.cuda.json"
want cache_policy && step cache_policy 300 python3 bench/cache_policy.py --device cuda --seeds 2 --workloads hot-burst,no-burst \
  --control-policies score --json "$OUT/cache_policy.cuda.json"
# loraplex on vLLM against the same vLLM in the same environment, loraplex's plugin active in both (the
# layer's own cost; --servers vllm adds vLLM as released): a Llama-3-8B-shaped random model, 64 adapters of ranks 8-64, bf16;
# seed scenario, Zipf, uniform, base-model only, and mixed base and adapter requests (needs vllm
# importable; skipped with a line when it is not).
if want vs_vllm_gpu; then
  if python3 -c "import vllm" 2>/dev/null; then
    step vs_vllm_gpu 660 python3 bench/vs_vllm_gpu.py /tmp/loraplex-vs-vllm --quick \
      --servers vllm+plugin,loraplex-vllm --json "$OUT/vs_vllm_gpu.json"
  else
    echo "== vs_vllm_gpu: skipped (vllm is not importable)" | tee -a "$LOG"
  fi
fi
# Not in the default set (about as long again as cache_policy): the change of traffic after the seed scenario.
[[ " ${GPU_CHECKS:-} " == *" cache_shift "* ]] && step cache_shift 420 python3 bench/cache_policy.py --device cuda \
  --seeds 1 --workloads shift,shift-control --control-policies score --json "$OUT/cache_shift.cuda.json"
# Not in the default set either (six runs of a 20-second trace, the bench's --quick form): fair share at the
# router with the two workers on the GPU (serve's device "auto"), where a batch's step costs about what one
# request's does.
[[ " ${GPU_CHECKS:-} " == *" fair_share "* ]] && step fair_share 420 python3 bench/fair_share.py --quick \
  --json "$OUT/fair_share.cuda.json"
grep -E "^== |passed|failed|FAILED|ERROR" "$LOG" | tail -n 40
