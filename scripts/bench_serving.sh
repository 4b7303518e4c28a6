#!/usr/bin/env bash
# Serving load test, eager and piecewise side by side, at concurrency 1, 8 and 32 (loopback only).
# Usage: scripts/bench_serving.sh [OUT_DIR]   (default docs/serving) — writes one JSON + PNG per run.
# The load generator runs at nice 19: on a 2-core box it would otherwise take CPU from the server it measures
# (a real client sits on another machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/serving}
mkdir -p "$out"
port=18090
for mode in eager piecewise; do
  flags=()
  [ "$mode" = piecewise ] && flags=(--enable-piecewise-graph)
  .venv/bin/kiln serve --port "$port" "${flags[@]}" > "$out/server-$mode.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do
    grep -q "Ready:" "$out/server-$mode.log" && break
    sleep 1
  done
  for c in 1 8 32; do
    n=$(( c == 1 ? 8 : 2 * c ))
    nice -n 19 .venv/bin/kiln loadtest --url "http://127.0.0.1:$port" --concurrency "$c" --num-requests "$n" \
      --input-len 32:256 --output-len 16:128 --seed 0 --timeout 600 \
      --json "$out/$mode-c$c.json" --plot "$out/$mode-c$c.png"
  done
  kill -INT "$pid"
  wait "$pid" || true
  trap - EXIT
done
