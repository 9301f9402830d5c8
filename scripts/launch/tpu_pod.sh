#!/bin/bash
# jaxtrain on a Cloud TPU VM pod slice (e.g. v5p-128: 16 hosts × 4 chips): the same command
# on every worker; jax.distributed finds the other workers from the TPU metadata.
#   scripts/launch/tpu_pod.sh TPU_NAME ZONE configs/gpt13b.py [--config.KEY=VALUE ...]
# Expects: the TPU VM created (gcloud compute tpus tpu-vm create ... --version=tpu-ubuntu2204-base),
# and a directory every host sees for --workdir, so that every host writes its checkpoint shards:
# a shared disk, or a GCS bucket mounted at the same path on every worker (gcsfuse
# --implicit-dirs BUCKET /mnt/gcs). A gs:// --workdir works for a job of one process
# (docs/operations.md, "Object storage"); for the several hosts of a pod slice it is refused
# in one line until the checkpoint shards of every host can be committed there.
# Check that it worked: worker 0 prints "on 64 tpu devices" for v5p-128 (4 chips × 16 hosts).
set -euo pipefail
TPU=${1:?tpu name}; ZONE=${2:?zone}; CONFIG=${3:?config}; shift 3
WORKDIR=${WORKDIR:-/mnt/gcs/jaxtrain/$(basename "$CONFIG" .py)}
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d jaxtrain ] || git clone https://example.invalid/your/jaxtrain.git jaxtrain
  cd jaxtrain && python3 -m pip install -q -e '.[tpu]'
  # Exit 75 (the workdir in use: a dead run's lease, stale JAXTRAIN_LEASE_STALE_S after its
  # last heartbeat) is retried after that wait, up to 5 times; every worker exits 75 together.
  for try in 1 2 3 4 5; do
    set +e; python3 -m jaxtrain.main --config $CONFIG --workdir $WORKDIR $*; status=\$?; set -e
    [ \$status -eq 75 ] || exit \$status
    sleep \${JAXTRAIN_LEASE_STALE_S:-300}
  done
  exit 75
"
