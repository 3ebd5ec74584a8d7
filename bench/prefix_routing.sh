#!/usr/bin/env bash
# Prefill routing on the KV index against round-robin, with 1 and with 2 routers, one server
# at a time on this machine: `pdserve serve` with PREFILL prefill + DECODE decode workers
# (default 2 + 2; COLOCATED=1: DECODE colocated workers) on the built-in tiny model (or
# MODEL=DIR, e.g. SmolLM2-135M from the peer set-up), then `pdserve bench serve --dataset
# prefix` (conversations over shared system prompts that resend their history), its requests
# spread over the routers in turn. Every worker's KV pool is pinned to KV_BLOCKS (default 512
# blocks of 16 tokens) and the context to MAX_MODEL_LEN (default 1024), so one worker's cache
# cannot hold every conversation. Prints the cluster's prefix-cache hit rate beside TTFT and
# throughput for each; the JSON results and logs go to OUT (default
# /tmp/pdserve-prefix-routing). Run from the repository root after `make venv`:
#   bash bench/prefix_routing.sh
set -euo pipefail
OUT=${OUT:-/tmp/pdserve-prefix-routing}
PROMPTS=${PROMPTS:-128}
CONCURRENCY=${CONCURRENCY:-8}
INPUT_MEAN=${INPUT_MEAN:-200}
PREFILL=${PREFILL:-2}
DECODE=${DECODE:-2}
ROUTERS=${ROUTERS:-"1 2"}
ROUTINGS=${ROUTINGS:-"prefix round-robin"}
SERVE_FLAGS=(--num-kv-blocks "${KV_BLOCKS:-512}" --max-model-len "${MAX_MODEL_LEN:-1024}")
if [[ -n "${MODEL:-}" ]]; then SERVE_FLAGS+=(--model "$MODEL"); fi
# COLOCATED=1: DECODE colocated workers instead (each prefills its own prompts)
if [[ "${COLOCATED:-0}" == 1 ]]; then POOLS=(--colocated --decode "$DECODE")
else POOLS=(--prefill "$PREFILL" --decode "$DECODE"); fi
mkdir -p "$OUT"
for routers in $ROUTERS; do
  for routing in $ROUTINGS; do
    label="$routing-$routers"
    log="$OUT/serve-$label.log"
    .venv/bin/pdserve serve "${SERVE_FLAGS[@]}" "${POOLS[@]}" \
      --routers "$routers" --worker-cpus 0 --port 0 --metrics-port none \
      --prefill-routing "$routing" > "$log" 2>&1 &
    server=$!
    # every router's gRPC address, from the line `pdserve serve` prints once it serves
    targets=""
    for _ in $(seq 600); do
      targets=$(sed -n 's/^pdserve: gRPC on \(.*\), metrics on .*/\1/p' "$log" | tr -d ' ')
      if [[ -n "$targets" ]] || ! kill -0 "$server" 2>/dev/null; then break; fi
      sleep 0.5
    done
    if [[ -z "$targets" ]]; then echo "$label: the server did not start, see $log"; exit 1; fi
    .venv/bin/pdserve bench serve --target "$targets" --wait-ready-s 180 --dataset prefix \
      --num-prompts "$PROMPTS" --max-concurrency "$CONCURRENCY" --input-mean "$INPUT_MEAN" \
      --output-mean 16 --disable-tqdm --save-result "$OUT/$label.json" \
      > "$OUT/bench-$label.log" 2>&1 || true
    kill -INT "$server"
    wait "$server" || true
    .venv/bin/python - "$OUT/$label.json" "$routing" "$routers" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
hit = r.get("prefix_hit_rate")
print(f"{sys.argv[2]:>12}, {sys.argv[3]} router(s): prefix hit rate "
      f"{'n/a' if hit is None else f'{hit:.1%}'} | TTFT P50 {r['median_ttft_ms']:.1f} ms, "
      f"P99 {r['p99_ttft_ms']:.1f} ms | output {r['output_throughput']:.1f} tok/s | "
      f"{r['completed']} of {r['num_prompts']} completed", flush=True)
PY
  done
done
