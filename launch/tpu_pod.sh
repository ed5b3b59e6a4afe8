#!/usr/bin/env bash
# Runs the main job on every worker of a Cloud TPU pod slice, one log per worker.
#   launch/tpu_pod.sh TPU_NAME ZONE -- --config=configs/gsm8k.py:qwen3 --workdir=/mnt/bucket/run
# Each worker installs the package with the `tpu` extra, then runs the same command with
# DIVERSED_DISTRIBUTED=1: diversed_jax.parallel.hosts.initialize_distributed() joins the
# hosts (jax.distributed discovers the pod from the TPU metadata), each call's rows are
# split over every chip, and only process 0 writes the workdir. The workdir must be a
# local path; for one bucket folder seen by every worker, mount it first (gcsfuse).
# The arguments after -- reach the workers' shell quoted (printf %q), so values such as
# --config.methods.static_weights='(0.4,0.8)' arrive unchanged.
set -euo pipefail
tpu="$1"; zone="$2"; shift 2
[ "${1:-}" = "--" ] && shift
args=$(printf ' %q' "$@")
repo=$(cd "$(dirname "$0")/.." && pwd)
archive=/tmp/diversed_jax_src.tar.gz
tar -C "$repo" --exclude=.git --exclude=runs --exclude=workdirs -czf "$archive" .
gcloud compute tpus tpu-vm scp "$archive" "$tpu":~/src.tar.gz --zone="$zone" --worker=all
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="
  set -e; mkdir -p ~/diversed_jax && tar -C ~/diversed_jax -xzf ~/src.tar.gz
  cd ~/diversed_jax && ./install.sh tpu
  DIVERSED_DISTRIBUTED=1 python3 -m diversed_jax.main$args > ~/diversed_jax_\$(hostname).log 2>&1"
echo "logs: ~/diversed_jax_<worker hostname>.log on each worker"
