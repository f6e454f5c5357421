#!/usr/bin/env bash
# Distil kvfree-demo (Echo) and its Mamba-2 twin on one GPU: the labelled data once, then both students side by side.
#
#   training/demo_all.sh TEACHER.gguf OUT [more `python -m kvfree.training.demo` arguments for both students]
#
# Writes OUT/data/, OUT/echo/ and OUT/mamba2/ (tokenizer, state, checkpoint, report.json) and OUT/{echo,mamba2}.log.
# Run it again to resume: finished stages are kept.
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
teacher=$1
out=$2
shift 2
mkdir -p "$out"
python -m kvfree.training.demo --teacher "$teacher" --out "$out/echo" --data "$out/data" --data-only "$@"
for family in echo mamba2; do
    python -m kvfree.training.demo --teacher "$teacher" --out "$out/$family" --data "$out/data" \
        --family "$family" --memory-fraction 0.48 "$@" >"$out/$family.log" 2>&1 &
done
wait
