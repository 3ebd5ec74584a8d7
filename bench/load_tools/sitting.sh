#!/usr/bin/env bash
# The comparison of docs/benchmarking.md in one sitting: every tool and pdserve bench serve at
# each concurrency, interleaved (tool after tool, then the next concurrency), REPS times over,
# into ROOT/TOOL-cC-rR, then the table (bench/load_tools/summary.py).
#   GRPC_TARGET=127.0.0.1:50051 bash bench/load_tools/sitting.sh BASE_URL MODEL ROOT
# CONCURRENCY (default "1 4"), NUM_REQUESTS_PER_STREAM (default 8: 8 requests at concurrency
# 1, 32 at 4), REPS (default 2), TOOLS (default all four); run.sh's INPUT_LEN, OUTPUT_LEN,
# TOKENIZER, PYTHON and METRICS_URL pass through.
set -euo pipefail

if (($# != 3)); then
    sed -n 2,8p "$0" >&2
    exit 2
fi
BASE_URL=$1 MODEL=$2 ROOT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
mkdir -p "$ROOT"
for ((rep = 1; rep <= ${REPS:-2}; rep++)); do
    for concurrency in ${CONCURRENCY:-1 4}; do
        for tool in ${TOOLS:-pdserve aiperf guidellm inference-perf}; do
            out=$ROOT/$tool-c$concurrency-r$rep
            echo "$(date -u +%H:%M:%S) $tool concurrency $concurrency repetition $rep" >&2
            bash "$HERE/run.sh" "$tool" "$BASE_URL" "$MODEL" "$concurrency" \
                $((concurrency * ${NUM_REQUESTS_PER_STREAM:-8})) "$out" > "$out.log" 2>&1 ||
                echo "$tool failed: see $out.log" >&2
        done
    done
done
# shellcheck disable=SC2086  # (PYTHON may carry flags: "python -P")
$PYTHON -m pdserve.bench.load_tools.summary "$ROOT"
