#!/usr/bin/env bash
# The checks that need a GPU, in one run, for a machine that has python3 with torch, Triton,
# transformers, tokenizers and safetensors and nothing of this project installed (ray, Redis
# and the front doors are not needed): the real CUDA-graph capture test, the decoder on the
# compiled Triton kernels and KV from a GPU pool into a CPU pool, then the CUDA-graph and
# kernel benchmarks, and on a machine with two GPUs or more the tensor parallel benchmark
# (TP=1 vs TP=2 over NCCL). Each part's output goes to $OUT (or a temporary folder) as well as
# to the terminal; a failing part does not stop the next. About 3-6 minutes on an H200, most
# of it Triton compiling.
#   bash bench/device_check.sh      (PYTHON=... picks the interpreter; python3 by default)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shim=$(mktemp -d)  # the checkout is the package: import it as pdserve
ln -s "$root" "$shim/pdserve"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
out=${OUT:-$shim}
python=${PYTHON:-python3}
status=0
run() {  # run NAME COMMAND...: tee its output to $out/NAME.txt, remember a failure
  local name=$1
  shift
  echo "== $name: $*"
  (cd "$root" && "$@") 2>&1 | tee "$out/$name.txt" || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
run tests "$python" -m pytest -q -p no:cacheprovider \
  tests/engine/test_cuda_graphs.py tests/models/test_triton_backend.py \
  tests/kv_transfer/test_gpu_to_cpu.py
run cuda_graphs "$python" -m pdserve.bench.cuda_graphs
run kernels "$python" -m pdserve.bench.kernels
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then  # TP=1 vs TP=2 prefill and decode over NCCL, tokens compared
  run tensor_parallel "$python" -m pdserve.bench.tensor_parallel --device cuda --sizes 1,2
else
  echo "== tensor_parallel: skipped, $gpus GPU(s) visible (TP=2 needs 2)"
fi
echo "== outputs in $out; status $status"
exit $status
