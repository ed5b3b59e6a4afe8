#!/usr/bin/env bash
# Runs the main job on one multi-GPU node (all visible GPUs form the 'data' mesh axis).
#   launch/gpu_node.sh --config=configs/gsm8k.py:llama --workdir=runs/llama_gsm8k
# For several nodes, start this on each with JAX_COORDINATOR_ADDRESS=host0:1234,
# JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i set; initialize_distributed() picks them up.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax; assert jax.default_backend() == 'gpu', 'run ./install.sh gpu first'"
exec python3 -m diversed_jax.main "$@"
