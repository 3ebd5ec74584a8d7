#!/usr/bin/env bash
# Prefill routing on the KV index against round-robin, one after the other on this machine:
# `pdserve serve` with 2 prefill + 1 decode workers on the built-in tiny model (or MODEL=DIR),
# then `pdserve bench serve --dataset prefix` (conversations over shared system prompts that
# resend their history). Prints the cluster's prefix-cache hit rate beside TTFT and
# throughput for each; the JSON results go to OUT (default /tmp/pdserve-prefix-routing).
# Run from the repository root after `make venv`: bash bench/prefix_routing.sh
set -euo pipefail
OUT=${OUT:-/tmp/pdserve-prefix-routing}
PORT=${PORT:-50071}
PROMPTS=${PROMPTS:-128}
MODEL_FLAG=()
if [[ -n "${MODEL:-}" ]]; then MODEL_FLAG=(--model "$MODEL"); fi
mkdir -p "$OUT"
for routing in prefix round-robin; do
  .venv/bin/pdserve serve "${MODEL_FLAG[@]}" --prefill 2 --decode 1 --worker-cpus 0 \
    --port "$PORT" --metrics-port none --prefill-routing "$routing" > "$OUT/serve-$routing.log" 2>&1 &
  server=$!
  .venv/bin/pdserve bench serve --target "127.0.0.1:$PORT" --wait-ready-s 180 --dataset prefix \
    --num-prompts "$PROMPTS" --max-concurrency 8 --input-mean 200 --output-mean 16 \
    --disable-tqdm --save-result "$OUT/$routing.json" > "$OUT/bench-$routing.log" 2>&1 || true
  kill -INT "$server"
  wait "$server" || true
  .venv/bin/python - "$OUT/$routing.json" "$routing" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
hit = r.get("prefix_hit_rate")
print(f"{sys.argv[2]:>12}: prefix hit rate {hit:.1%} | TTFT P50 {r['median_ttft_ms']:.1f} ms, "
      f"P99 {r['p99_ttft_ms']:.1f} ms | output {r['output_throughput']:.1f} tok/s | "
      f"{r['completed']} of {r['num_prompts']} completed" if hit is not None else "no hit rate")
PY
done
