#!/usr/bin/env bash
# Runs the main job on every worker of a Cloud TPU pod slice, one log per worker.
#   launch/tpu_pod.sh TPU_NAME ZONE -- --config=configs/gsm8k.py:qwen3 --workdir=gs://bucket/run
# Each worker installs the package with the `tpu` extra, then runs the same command;
# diversed_jax.parallel.mesh.initialize_distributed() joins the hosts (jax.distributed
# discovers the pod from the TPU metadata), and the batch axis spans every chip.
set -euo pipefail
tpu="$1"; zone="$2"; shift 2
[ "${1:-}" = "--" ] && shift
repo=$(cd "$(dirname "$0")/.." && pwd)
archive=/tmp/diversed_jax_src.tar.gz
tar -C "$repo" --exclude=.git --exclude=runs --exclude=workdirs -czf "$archive" .
gcloud compute tpus tpu-vm scp "$archive" "$tpu":~/src.tar.gz --zone="$zone" --worker=all
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="
  set -e; mkdir -p ~/diversed_jax && tar -C ~/diversed_jax -xzf ~/src.tar.gz
  cd ~/diversed_jax && ./install.sh tpu
  python3 -m diversed_jax.main $* > ~/diversed_jax_\$(hostname).log 2>&1"
echo "logs: ~/diversed_jax_<worker hostname>.log on each worker"
