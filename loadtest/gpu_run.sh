#!/usr/bin/env bash
# The GPU load test behind BENCHMARKS.md: a Mamba-2 server and its attention baseline of equal width and depth on
# one GPU, then `kvfree loadtest --gpu` against both. Run from the repository root:
#
#   loadtest/gpu_run.sh [OUT_DIR] [MODEL_PRESET] [BASELINE_PRESET]     (default: loadtest-gpu mamba2-370m attention-370m)
#
# Both checkpoints are random-initialised presets (the shapes of state-spaces/mamba2-370m): memory and speed do not
# depend on the weights. The baseline's KV cache is preallocated for 128K-token sessions, two of them.
set -euo pipefail
OUT_DIR=${1:-loadtest-gpu}
MODEL=${2:-mamba2-370m}
BASELINE=${3:-attention-370m}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT_DIR"
# kvfree must be installed (its folders map into the `kvfree` package); offline machines install without deps.
$PY -c "import kvfree.engine" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e .

$PY -m kvfree init-checkpoint "$MODEL" --dtype bfloat16 "$WORK/$MODEL"
$PY -m kvfree init-checkpoint "$BASELINE" --dtype bfloat16 "$WORK/$BASELINE"

# Room for 128K-token prompts; 8192-token prefill chunks per engine step; 256 slots so 256 clients decode at once.
$PY -m kvfree serve "$WORK/$MODEL" --port 8000 --max-sessions 256 --max-waiting 1024 \
    --max-batch-tokens 8192 --max-prompt-tokens 131200 --max-host-sessions 4096 >"$OUT_DIR/server.log" 2>&1 &
SERVER=$!
$PY -m kvfree serve "$WORK/$BASELINE" --port 8001 --max-sessions 2 --max-waiting 1024 \
    --max-batch-tokens 8192 --max-prompt-tokens 131200 --max-context 131200 >"$OUT_DIR/baseline.log" 2>&1 &
BASE=$!
trap 'kill $SERVER $BASE 2>/dev/null || true; rm -rf "$WORK"' EXIT

$PY - <<'PYEOF'
import time, urllib.request
for port in (8000, 8001):
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the server on :{port} did not get ready in 300 s (see its log)")
            time.sleep(0.5)
PYEOF

GIB=$($PY -c 'import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if torch.cuda.is_available() else 80)')
$PY -m kvfree loadtest --gpu --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \
    --device-memory-gib "$GIB" --no-progress --out "$OUT_DIR" "${@:4}"
