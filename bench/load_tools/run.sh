#!/usr/bin/env bash
# One load run against a running OpenAI-compatible server, by one tool, at one shape:
#   bash bench/load_tools/run.sh TOOL BASE_URL MODEL CONCURRENCY NUM_REQUESTS OUT_DIR
# TOOL: aiperf | guidellm | inference-perf (venvs from setup.sh) | pdserve (pdserve bench serve,
# which also needs GRPC_TARGET, the server's gRPC HOST:PORT, for the model info).
# Every request: INPUT_LEN prompt tokens (default 256), OUTPUT_LEN generated (default 64,
# ignore_eos), streamed /v1/completions. TOKENIZER: the model's folder (the tools count tokens
# with it; nothing is fetched from a hub). The tool's own report lands in OUT_DIR;
# bench/load_tools/summary.py reads the four kinds into one table. METRICS_URL (pdserve's
# Prometheus endpoint, e.g. http://127.0.0.1:9400/metrics): scraped before and after the run,
# so the summary shows the router's own TTFT and ITL for the run beside the tool's. The CPU
# time the client used (user and system, its processes together) goes to OUT_DIR/client-cpu.txt:
# on a machine the client shares with the server, it is time the server did not get.
set -euo pipefail

if (($# != 6)); then
    sed -n 2,8p "$0" >&2
    exit 2
fi
TOOL=$1 BASE_URL=${2%/} MODEL=$3 CONCURRENCY=$4 NUM_REQUESTS=$5 OUT_DIR=$6
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
TOKENIZER=${TOKENIZER:-/tmp/peer-model/smollm2-hf}
PYTHON=${PYTHON:-python}  # the interpreter that imports pdserve (pdserve bench serve)
mkdir -p "$OUT_DIR"
export HF_HUB_DISABLE_TELEMETRY=1

scrape() {  # the server's metrics now, into OUT_DIR/metrics-$1.txt (with METRICS_URL)
    if [[ -n ${METRICS_URL:-} ]]; then
        curl -sf "$METRICS_URL" > "$OUT_DIR/metrics-$1.txt" || echo "run.sh: no $METRICS_URL" >&2
    fi
}

scrape before
case $TOOL in
aiperf)
    # (no HF_HUB_OFFLINE: aiperf 0.13.0's offline mode looks a local folder up in the hub cache
    # and fails; online, an absolute path loads from disk without touching the network)
    /tmp/tool-aiperf/bin/aiperf profile --model "$MODEL" --url "$BASE_URL" \
        --endpoint-type completions --streaming --tokenizer "$TOKENIZER" \
        --isl "$INPUT_LEN" --isl-stddev 0 --osl "$OUTPUT_LEN" --osl-stddev 0 \
        --extra-inputs ignore_eos:true --concurrency "$CONCURRENCY" \
        --request-count "$NUM_REQUESTS" --random-seed 0 \
        --artifact-dir "$OUT_DIR" --ui none
    ;;
guidellm)
    HF_HUB_OFFLINE=1 /tmp/tool-guidellm/bin/guidellm run \
        --backend "kind=openai_http,target=$BASE_URL,model=$MODEL,request_format=/v1/completions" \
        --profile "kind=concurrent,streams=$CONCURRENCY" \
        --data "kind=synthetic_text,prompt_tokens=$INPUT_LEN,output_tokens=$OUTPUT_LEN" \
        --tokenizer "kind=hf_auto,model=$TOKENIZER" \
        --constraint "kind=max_requests,count=$NUM_REQUESTS" \
        --output "kind=json,path=$OUT_DIR/guidellm.json" --disable-progress
    ;;
inference-perf)
    cat > "$OUT_DIR/config.yml" <<EOF
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: $MODEL
  base_url: $BASE_URL
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: $TOKENIZER
data:
  type: random
  input_distribution: {min: $INPUT_LEN, max: $INPUT_LEN, mean: $INPUT_LEN, std_dev: 0, total_count: $NUM_REQUESTS}
  output_distribution: {min: $OUTPUT_LEN, max: $OUTPUT_LEN, mean: $OUTPUT_LEN, std_dev: 0, total_count: $NUM_REQUESTS}
load:
  type: concurrent
  stages:
  - {num_requests: $NUM_REQUESTS, concurrency_level: $CONCURRENCY}
report:
  request_lifecycle: {summary: true, per_stage: false, per_request: false}
storage:
  local_storage: {path: $OUT_DIR}
EOF
    HF_HUB_OFFLINE=1 /tmp/tool-inference-perf/bin/inference-perf -c "$OUT_DIR/config.yml"
    ;;
pdserve)
    : "${GRPC_TARGET:?pdserve bench serve needs GRPC_TARGET, the gRPC HOST:PORT of the server}"
    trace=$OUT_DIR/trace.jsonl
    : > "$trace"
    for ((i = 0; i < NUM_REQUESTS; i++)); do
        echo "{\"prompt_len\": $INPUT_LEN, \"output_len\": $OUTPUT_LEN}" >> "$trace"
    done
    # shellcheck disable=SC2086  # (PYTHON may carry flags: "python -P")
    $PYTHON -m pdserve.cli.main bench serve --target "$GRPC_TARGET" --base-url "$BASE_URL" \
        --dataset jsonl --dataset-path "$trace" --num-prompts "$NUM_REQUESTS" \
        --max-concurrency "$CONCURRENCY" --save-result "$OUT_DIR/pdserve.json" --disable-tqdm
    ;;
*)
    echo "run.sh: TOOL must be aiperf, guidellm, inference-perf or pdserve, got $TOOL" >&2
    exit 2
    ;;
esac
scrape after
times > "$OUT_DIR/client-cpu.txt"  # (bash's: this shell's user and system, then its children's)
