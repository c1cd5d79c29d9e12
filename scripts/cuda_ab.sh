#!/usr/bin/env bash
# Same-machine A/B of two builds of this distribution on a GPU: the step times of checkpointing and
# mini_sequence+checkpointing and the LM head against its anchors, for each wheel, on one machine in one call
# (H100 and H200 machines differ by up to 25% on the same step: compare only what ran together).
#
# Prepare where pip works: the two wheels (`make wheel` at each commit), the anchor's DeepSpeed wheels and the
# planner's file (see scripts/cuda_session.sh). Then on the GPU machine, from the repository root:
#   OLD=a.whl NEW=b.whl WHEELS=".whl/*.whl" OUT=<folder> bash scripts/cuda_ab.sh
# PARTS="name ..." runs only the named parts (steps_new steps_old anchors_new anchors_old steps_new_accumulating
# profile_new profile_4096_new steps_short_repeats_{new,old} streaming_16384_{new,old} exactness_new, then the
# policy_* parts), in that order. SEQS: the lengths timed (default 16384 32768), after SHORT_SEQS (default 4096). The policy_* parts time the new build
# under other chunk policies (scripts/policy_overrides.py; OLD may then be the same wheel as NEW): MLP mini-sequences
# of 4096 and 8192 tokens instead of "auto"'s hidden_size (fewer chunks, less host work per step), LM-head row blocks
# 4 and 2 per chunk instead of 8 (taller fp32 blocks for torch's one-thread-block-per-row softmax), LM-head chunks of
# at least 4096 tokens. Their planner estimates: cuda_check.py --planner-only with the same overrides, on a CPU.
# docs/cuda/README.md records such runs.
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-out/cuda_ab}
PLAN=${PLAN:-out/planner/planner_4096_16384_32768.json}
MODEL=${MODEL:-llama-1b}  # MODEL=tiny: a CPU smoke run (the GPU-only parts fail fast)
read -r -a seqs <<< "${SEQS:-16384 32768}"  # the lengths both builds are timed at (the accumulating head's too)
read -r -a short <<< "${SHORT_SEQS-4096}"  # ... and the steps and policy_mlp_chunk_* parts at these first
: "${OLD:?OLD=<wheel of the build to compare against>}" "${NEW:?NEW=<wheel of the build under test>}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
# shellcheck source=scripts/cuda_parts.sh
. "$(dirname "$0")/cuda_parts.sh"
for side in old new; do
    wheel=$OLD
    [ "$side" = new ] && wheel=$NEW
    # shellcheck disable=SC2086 # WHEELS is a list of globs
    install_wheels "${SITE_DIR:-/tmp}/mst_ab_$side" "$wheel" ${WHEELS:-} || exit 1
done
merge=()
[ -f "$PLAN" ] && merge=(--no-planner --merge-planner "$PLAN")

side_part() {  # side_part SECONDS NAME old|new COMMAND...: `part` with that build imported
    local limit=$1 name=$2 side=$3
    shift 3
    PYTHONPATH=${SITE_DIR:-/tmp}/mst_ab_$side${PYTHONPATH:+:$PYTHONPATH} part "$limit" "$name" "$@"
}

steps=(scripts/cuda_check.py --model "$MODEL" "${merge[@]}" --no-exactness --no-streaming)
anchors=(scripts/lm_head_anchors.py --device cuda --hidden 4096 --dtypes bf16 --tokens 8192 32768)
side_part 60 steps_new new "$PY" "${steps[@]}" --seq "${short[@]}" "${seqs[@]}" --out "$OUT/steps_new" \
    --methods checkpointing mini_sequence+checkpointing
side_part 60 steps_old old "$PY" "${steps[@]}" --seq "${short[@]}" "${seqs[@]}" --out "$OUT/steps_old" \
    --methods checkpointing mini_sequence+checkpointing
side_part 50 anchors_new new "$PY" "${anchors[@]}" --json "$OUT/anchors_new.json"
side_part 50 anchors_old old "$PY" "${anchors[@]}" --json "$OUT/anchors_old.json"
side_part 35 steps_new_accumulating new "$PY" "${steps[@]}" --seq "${seqs[@]}" --out "$OUT/steps_new_accumulating" \
    --methods mini_sequence+checkpointing --head accumulating
side_part 35 profile_new new "$PY" scripts/cuda_check.py --model "$MODEL" --profile --seq 16384 \
    --methods mini_sequence+checkpointing
# the 4K gap (0.64x-0.72x of checkpointing's speed on an H200; last profiled at mst.13, H100): both methods, one machine
side_part 35 profile_4096_new new "$PY" scripts/cuda_check.py --model "$MODEL" --profile --seq 4096 \
    --methods checkpointing mini_sequence+checkpointing
# the short length again, 10 steps each (3 steps at 4K spread over +-15% between calls of one machine), then
# mini_sequence+streaming at 16K (the streamed layers and the LM head's loss), each build
for side in new old; do
    side_part 45 "steps_short_repeats_$side" $side "$PY" "${steps[@]}" --seq "${short[@]}" --repeats 10 \
        --out "$OUT/steps_short_repeats_$side" --methods checkpointing mini_sequence+checkpointing
done
for side in new old; do
    side_part 45 "streaming_16384_$side" $side "$PY" "${steps[@]}" --seq 16384 --out "$OUT/streaming_16384_$side" \
        --methods mini_sequence+streaming
done
# exactness on CUDA of the new build (cuda_check.py's parts 1-3: fp32 flag off against chunks, the bf16 MLP against
# fp64, streaming in bf16 against fp32) and one step
side_part 80 exactness_new new "$PY" scripts/cuda_check.py --model "$MODEL" --no-planner --seq 4096 --repeats 1 \
    --methods checkpointing --out "$OUT/exactness_new"
for chunk in 4096 8192; do
    side_part 60 "policy_mlp_chunk_$chunk" new "$PY" scripts/cuda_check.py --model "$MODEL" --no-planner --no-exactness \
        --no-streaming --seq "${short[@]}" "${seqs[@]}" --out "$OUT/policy_mlp_chunk_$chunk" --methods mini_sequence+checkpointing \
        --mlp-chunk "$chunk"
done
for blocks in 4 2; do
    side_part 50 "policy_row_blocks_$blocks" new "$PY" "${anchors[@]}" --row-blocks "$blocks" \
        --json "$OUT/policy_row_blocks_$blocks.json"
done
side_part 50 policy_lm_head_min_tokens_4096 new "$PY" "${anchors[@]}" --lm-head-min-tokens 4096 \
    --json "$OUT/policy_lm_head_min_tokens_4096.json"
echo "total $(( $(date +%s) - start )) s"
