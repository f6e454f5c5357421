#!/usr/bin/env bash
# The device run behind docs/bench/ and BENCHMARKS.md's kernel and model-step tables, in one call:
#   1. the Triton kernel tests, compiled for the GPU (CI runs them interpreted on the CPU);
#   2. the Mamba-2 / conv ops checked at real sizes and timed, fla's kernels as anchors when fla-core imports;
#   3. the norm kernels checked and timed, the Gated KalmaNet kernels (against fla's MesaNet when it imports), and the
#      Lattice, SKA and B'MOJO kernels;
#   4. `kvfree bench` for a preset: decode at B = 1, 16, 64, 256 (CUDA graph and eager), one long prefill, and a
#      kernel-by-kernel profile of a decode step and the prefill;
#   5. `kvfree bench --offline`: LLM.generate of 256 prompts end to end and one alone, with a profile of an engine
#      step (device busy time against wall time, host functions).
# Run from the repository root:  kvfree/bench/kernels/gpu_run.sh [OUT_DIR] [PRESET]   (default: docs/bench mamba2-370m)
set -uo pipefail
OUT_DIR=${1:-docs/bench}
PRESET=${2:-mamba2-370m}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
# kvfree must be installed (its folders map into the `kvfree` package); offline machines install without deps.
$PY -c "import kvfree.engine" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
status=0
$PY -m pytest -q -p no:cacheprovider tests/kernels/test_mamba2.py tests/kernels/test_gka.py tests/kernels/test_gdn.py tests/kernels/test_attention.py tests/kernels/test_attention_prefill.py tests/kernels/test_lattice.py tests/kernels/test_ska.py tests/kernels/test_bmojo.py tests/kernels/test_bmojo_f.py tests/kernels/test_norm.py tests/kernels/test_model.py tests/engine/test_gpu_engine.py 2>&1 | tee "$OUT_DIR/kernel_tests.log" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
$PY -m kvfree.bench.kernels --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/kernels.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
$PY -m kvfree.bench.kernels.norm --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/norm.log" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for op in gka gdn attention attention_decode lattice ska bmojo bmojo_f; do
    $PY -m kvfree.bench.kernels --op $op --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/$op.log" | grep -v "^\[" | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
$PY -m kvfree.bench.step --preset "$PRESET" --profile --out "$OUT_DIR/model-$PRESET.json" 2>&1 | tee "$OUT_DIR/model.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
$PY -m kvfree.bench.step --offline --preset "$PRESET" --profile --out "$OUT_DIR/offline-$PRESET.json" 2>&1 \
    | tee "$OUT_DIR/offline.log" | grep -v -i warn
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
