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
archive=$(mktemp /tmp/diversed_jax_src.XXXXXX.tar.gz)  # one per launch
trap 'rm -f "$archive"' EXIT
tar -C "$repo" --exclude=.git --exclude=runs --exclude=workdirs -czf "$archive" .
gcloud compute tpus tpu-vm scp "$archive" "$tpu":~/src.tar.gz --zone="$zone" --worker=all
# The old copy goes (files deleted here must not linger there: a stale head folder under
# assets/heads would be picked up as shipped), but runs/ and workdirs/ stay: a rerun
# resumes. The job is detached (nohup, setsid), so a dropped ssh session does not end it.
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="
  set -e; mkdir -p ~/diversed_jax
  find ~/diversed_jax -mindepth 1 -maxdepth 1 ! -name runs ! -name workdirs -exec rm -rf {} +
  tar -C ~/diversed_jax -xzf ~/src.tar.gz
  cd ~/diversed_jax && ./install.sh tpu
  DIVERSED_DISTRIBUTED=1 setsid nohup python3 -m diversed_jax.main$args \\
      > ~/diversed_jax_\$(hostname).log 2>&1 < /dev/null &"
echo "started; logs: ~/diversed_jax_<worker hostname>.log on each worker"
