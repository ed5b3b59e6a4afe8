#!/usr/bin/env bash
# Runs the main job on one multi-GPU node: each decoding call's rows are split over all
# visible GPUs (the 'data' mesh axis, decode.mesh_data=-1; decode.batch_size must be a
# multiple of their number), and so are each head-training step's rows (train.mesh_data).
#   launch/gpu_node.sh --config=configs/gsm8k.py:llama --workdir=runs/llama_gsm8k \
#       --config.decode.batch_size=16
# For several nodes (every mode but distill), start this on each with
# JAX_COORDINATOR_ADDRESS=host0:1234, JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i set;
# diversed_jax.parallel.hosts.initialize_distributed() reads them, and only process 0
# writes the workdir.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax; assert jax.default_backend() == 'gpu', 'run ./install.sh gpu first'"
exec python3 -m diversed_jax.main "$@"
