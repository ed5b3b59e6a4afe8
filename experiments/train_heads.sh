#!/bin/bash
# Heads for the layer-skip draft self:4 (the default draft is now the feature draft: see
# train_heads_feature.sh). Resumable: rerunning continues from the last checkpoint.
cd "$(dirname "$0")/.."  # the repository root
COMMON="--train.prompts_per_step=2 --train.rollouts_per_prompt=2 --train.max_new_tokens=32 --train.num_draft=4 --train.temperature=0.7 --train.learning_rate=1e-3 --train.warmup_steps=1 --train.total_steps=8 --train.checkpoint_every=1 --train.head_layer_norm=True --train.max_prompt_tokens=512"
run() { name=$1; shift; nice -n 10 python3 -m diversed_jax.training --workdir=runs/heads/$name --draft=self:4 $COMMON "$@" >> runs/heads/$name.log 2>&1 \
  || { echo "$name failed: see runs/heads/$name.log" >&2; return 1; }; }
pids=()
mkdir -p runs/heads
run gsm8k_lam0.05 --task=gsm8k --train.lam=0.05 --ship_as=smollm2-135m-instruct_self4_gsm8k & pids+=($!)
run cnndm_lam0.05 --task=cnndm --max_source_words=150 --train.lam=0.05 --ship_as=smollm2-135m-instruct_self4_cnndm & pids+=($!)
run cnndm_lam0.5 --task=cnndm --max_source_words=150 --train.lam=0.5 & pids+=($!)
status=0; for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
