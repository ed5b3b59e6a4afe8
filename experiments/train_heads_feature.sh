#!/bin/bash
# Heads for the shipped distilled feature draft (the default draft of smollm2-135m-instruct).
# Resumable: rerunning continues from the last checkpoint. Workdirs under $RUNS (default
# runs/heads_step700; session 51 trained the shipped heads with RUNS=runs/heads_s51; use a
# new folder after re-shipping the draft, since a head trains against one draft version).
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/heads_step700}
COMMON="--train.prompts_per_step=2 --train.rollouts_per_prompt=2 --train.max_new_tokens=32 --train.num_draft=4 --train.temperature=0.7 --train.learning_rate=1e-3 --train.warmup_steps=1 --train.total_steps=8 --train.checkpoint_every=1 --train.head_layer_norm=True --train.max_prompt_tokens=512"
run() { name=$1; shift; nice -n 10 python3 -m diversed_jax.training --workdir=$RUNS/$name $COMMON "$@" >> $RUNS/$name.log 2>&1 \
  || { echo "$name failed: see $RUNS/$name.log" >&2; return 1; }; }
pids=()
mkdir -p "$RUNS"
run feature_gsm8k_lam0.05 --task=gsm8k --train.lam=0.05 --ship_as=smollm2-135m-instruct_feature_gsm8k & pids+=($!)
run feature_cnndm_lam0.05 --task=cnndm --max_source_words=150 --train.lam=0.05 --ship_as=smollm2-135m-instruct_feature_cnndm & pids+=($!)
status=0; for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# Second lambda on CNN/DM for the report (not a shipped default; copied to experiments/heads).
run feature_cnndm_lam0.5 --task=cnndm --max_source_words=150 --train.lam=0.5 || status=1
exit $status
