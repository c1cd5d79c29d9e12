#!/usr/bin/env bash
# One timed session of GPU measurements on a machine without network access, in priority order, each part under its
# own time limit so that a slow part (a compile) cannot eat the others' time. What each part writes stays if a later
# part is stopped. docs/cuda/README.md records such sessions.
#
# Prepare where pip works (the GPU machine may have none):
#   make wheel                                      # dist/transformers-<version>-py3-none-any.whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \
#       pydantic==2.14.4 pydantic-core==2.50.5 hjson==3.1.0 annotated-types typing-inspection
#   pip wheel --no-deps -w wheels deepspeed==0.19.8 # the ALST anchor of scripts/lm_head_anchors.py (optional)
#   python scripts/cuda_check.py --planner-only --seq 4096 16384 32768 --out out/planner
# Then on the GPU machine, from the repository root:
#   OUT=<folder for the results> WHEELS="dist/*.whl wheels/*.whl" bash scripts/cuda_session.sh
# The parts take about 12 minutes in all, more than one device call may run: PARTS="name ..." runs only those (their
# names are below), e.g. the first three in one call and the rest in the next.
set -u
PY=${PYTHON:-python3}  # the interpreter that has torch
OUT=${OUT:-out/cuda_session}
PLAN=${PLAN:-out/planner/planner_4096_16384_32768.json}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
# shellcheck source=scripts/cuda_parts.sh
. "$(dirname "$0")/cuda_parts.sh"
if [ -n "${WHEELS:-}" ]; then
    # shellcheck disable=SC2086 # WHEELS is a list of globs
    install_wheels /tmp/mst_site $WHEELS || exit 1
    export PYTHONPATH=/tmp/mst_site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch, transformers; print('transformers', transformers.__version__, 'torch', torch.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU (a smoke run: MODEL=tiny)')" || exit 1
model=(--model "${MODEL:-llama-1b}")  # MODEL=tiny: a CPU smoke run of this script (the GPU-only parts fail fast)
merge=()
[ -f "$PLAN" ] && merge=(--no-planner --merge-planner "$PLAN")

part 160 steps_4096_16384_32768 "$PY" scripts/cuda_check.py "${model[@]}" --seq 4096 16384 32768 "${merge[@]}" --no-exactness \
    --no-streaming --out "$OUT/steps" --methods vanilla checkpointing mini_sequence mini_sequence+checkpointing
# the same step with the accumulating LM head: the planner says slicing lowers no peak there (docs/cuda/README.md)
part 60 steps_accumulating_head_16384_32768 "$PY" scripts/cuda_check.py "${model[@]}" --seq 16384 32768 "${merge[@]}" \
    --no-exactness --no-streaming --out "$OUT/steps_accumulating_head" --methods mini_sequence+checkpointing --head accumulating
part 60 lm_head_bf16_d4096 "$PY" scripts/lm_head_anchors.py --device cuda --hidden 4096 --dtypes bf16 \
    --tokens 8192 32768 --json "$OUT/lm_head_bf16_d4096.json"
part 120 streaming_4096_16384 "$PY" scripts/cuda_check.py "${model[@]}" --seq 4096 16384 "${merge[@]}" --out "$OUT/streaming" \
    --methods streaming mini_sequence+streaming mini_sequence+streaming+offload
# streaming is host-bound at 16K on Llama-3.2-1B shapes (docs/cuda/README.md): fewer, larger chunks than "auto"'s 2048
# tokens, for the step time they buy and the peak they cost
for chunk in 4096 8192; do
    part 40 "streaming_chunk_${chunk}_16384" "$PY" scripts/cuda_check.py "${model[@]}" --seq 16384 --no-exactness \
        --no-streaming --no-planner --methods streaming --streaming-chunk "$chunk" --out "$OUT/streaming_chunk_$chunk"
done
part 60 profile_streaming_16384 "$PY" scripts/cuda_check.py "${model[@]}" --profile --seq 16384 --methods mini_sequence+streaming
# where mini_sequence+checkpointing's time goes against checkpointing's (the issue's 0.97x target)
part 70 profile_ms_checkpointing_16384 "$PY" scripts/cuda_check.py "${model[@]}" --profile --seq 16384 \
    --methods checkpointing mini_sequence+checkpointing
# the compiled steps since the mini-sequence blocks are operators of the graph (mst.36-38): peak and speed against the
# eager step with the field and compiled checkpointing, one machine (issue 47's GPU targets)
part 300 compiled_4096_16384 "$PY" scripts/cuda_check.py "${model[@]}" --seq 4096 16384 "${merge[@]}" --no-exactness \
    --no-streaming --out "$OUT/compiled_4096_16384" \
    --methods mini_sequence+checkpointing+compile checkpointing+compile mini_sequence+checkpointing
part 100 streaming_steps_16384 "$PY" scripts/cuda_check.py "${model[@]}" --seq 16384 "${merge[@]}" --no-exactness \
    --no-streaming --out "$OUT/streaming_steps_16384" --methods checkpointing streaming mini_sequence+streaming
# Kimi-Linear's fp32 error on CUDA (docs/cuda/README.md, mst.30): with cuDNN's TF32 convolutions off
part 80 hybrid_exactness_no_tf32 "$PY" scripts/hybrid_cuda.py --exactness --no-tf32 --json "$OUT/hybrid_exactness_no_tf32.json"
# the same steps one process each: a process's earlier compiled models may hold memory its later rows count
# (cuda_check.py's allocated_after_bytes); the graph breaks' reasons logged
for seq in 4096 16384; do
    for method in mini_sequence+checkpointing+compile checkpointing+compile mini_sequence+checkpointing; do
        name=alone_${method//+/_}_$seq  # no "+": the device tool returns no file with one in its name
        part 75 "$name" env TORCH_LOGS=graph_breaks "$PY" scripts/cuda_check.py "${model[@]}" --seq "$seq" \
            "${merge[@]}" --no-exactness --no-streaming --out "$OUT/$name" --methods "$method"
    done
done
# the streamed chunks' attention kernels against the unsplit causal attention's (scripts/chunk_attention_cuda.py)
part 60 chunk_attention_16384 "$PY" scripts/chunk_attention_cuda.py --json "$OUT/chunk_attention_16384.json"
part 140 compiled_4096 "$PY" scripts/cuda_check.py "${model[@]}" --seq 4096 "${merge[@]}" --no-exactness --no-streaming \
    --out "$OUT/compiled" --methods mini_sequence+checkpointing+compile checkpointing+compile streaming+compile
echo "total $(( $(date +%s) - start )) s"
