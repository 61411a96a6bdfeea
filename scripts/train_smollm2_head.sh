#!/usr/bin/env bash
# Distill, train and save a DART head for SmolLM2-135M-Instruct inside one time budget (default 480 s: the
# 8-minute GPU recipe of README "Training a head on a GPU"). On one H200-class GPU: greedy self-distillation of
# the 8,770 built-in mixed prompts (about 90 s at batch 1280), then `dart-spec train --time-budget` on that data
# plus any EXTRA_DATA directories, ending with the final evaluation, a 3-gram of the training data and OUT/run/head.
#
#   scripts/train_smollm2_head.sh OUT [BUDGET_SECONDS] [more `dart-spec train` arguments, which win]
#
# Environment: GSM8K (required: GSM8K's train.jsonl), DEVICE (auto), EXTRA_DATA (space-separated shard
# directories, e.g. "$(echo data/smollm2-distill/*)", made as docs/training.md says), DISTILL_LIMIT (all prompts),
# DISTILL_BATCH (1280),
# MAX_NEW_TOKENS (256), DART_SPEC (dart-spec). Re-running resumes the distillation (existing shards are kept);
# the training directory OUT/run must not exist yet.
set -euo pipefail
start=$(date +%s)
out=${1:?usage: scripts/train_smollm2_head.sh OUT [BUDGET_SECONDS] [dart-spec train arguments]}
budget=${2:-480}
shift $(( $# < 2 ? $# : 2 ))
dart_spec=${DART_SPEC:-dart-spec}
device=${DEVICE:-auto}
gsm8k=${GSM8K:?set GSM8K to the path of GSM8K train.jsonl (OpenAI grade-school-math)}
limit=()
[ -n "${DISTILL_LIMIT:-}" ] && limit=(--limit "$DISTILL_LIMIT")
[ -e "$out/run" ] && { echo "train_smollm2_head.sh: $out/run exists; choose a new OUT" >&2; exit 2; }

$dart_spec distill --mixed "$gsm8k" --out "$out/distill-greedy" --batch-size "${DISTILL_BATCH:-1280}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-256}" --device "$device" "${limit[@]}"

left=$(( budget - ($(date +%s) - start) - 15 ))  # 15 s: the train command's start-up (imports, before its clock)
[ "$left" -ge 30 ] || { echo "train_smollm2_head.sh: only ${left} s of the budget left after distillation" >&2; exit 1; }
# shellcheck disable=SC2086  # EXTRA_DATA is a list of directories
$dart_spec train --target smollm2 --data "$out/distill-greedy" ${EXTRA_DATA:-} --out "$out/run" \
    --time-budget "$left" --device "$device" --target-dtype float32 --draft-length 6 --draft-vocab-size 8192 --batch-size 32 \
    --seq-len 512 --anchors 32 --lr 1e-3 --warmup-steps 100 --eval-every 500 --eval-sequences 64 \
    --checkpoint-every 500 --tau-prompts 4 --ngram "$@"
echo "train_smollm2_head.sh: $out/run/head in $(( $(date +%s) - start )) s of a ${budget} s budget"
