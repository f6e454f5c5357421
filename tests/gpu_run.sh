#!/usr/bin/env bash
# The suite's GPU checks on a machine where kvfree is not installed (a lent device): the Triton kernels compiled,
# CUDA-graph decode and prefill against eager, the launcher's cache, and no host sync in a launched step.
#
#   bash tests/gpu_run.sh                 # from the repository root; pytest's extra arguments may follow
#
# `import kvfree.<sub>` needs the installed package's layout: without an install, links inside kvfree/ to the
# top-level folders give it (they are made here, on the device's copy of the tree). The server's tests need
# fastapi, uvicorn, pydantic, openai and redis too: carry their cp312 wheels and put them on PYTHONPATH first.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in checkpoints clients engine kernels loadtest server training; do ln -sfn "../$d" "kvfree/$d"; done
export PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_engine.py tests/kernels/test_launcher.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_cuda_graphs.py tests/kernels/test_rows.py \
    tests/engine/test_state_pool.py tests/engine/test_gpu_sessions.py tests/kernels/test_mamba2.py \
    tests/kernels/test_norm.py tests/kernels/test_attention.py tests/kernels/test_gka.py tests/kernels/test_ska.py \
    tests/kernels/test_lattice.py tests/kernels/test_bmojo.py tests/kernels/test_model.py "$@"
