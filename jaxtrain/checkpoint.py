"""Checkpoints of a pytree of arrays and the run's config: async, atomic, checksummed, in
one of two tiers, picked by where the directory is.

- On disk (jaxtrain/checkpoint_local.py): orbax writes each step into a temporary directory
  and renames it; a manifest beside it records every file's size and xxh3.
- On a bucket, gs:// or s3:// (jaxtrain/checkpoint_remote.py): in place, through the shard
  store (jaxtrain/checkpoint_shards.py). Each process writes only the shards it owns straight
  to the bucket (its part and its index: 2 objects per process, whatever the number of
  arrays), process 0 the commit marker last once every process has written; a restore reads
  on each process only the byte ranges its devices hold, checks each piece's xxh3, and
  combines the processes' verdicts. Nothing of a step is staged or downloaded to a host's
  disk: a host needs no more disk for a checkpoint than for none.

Both tiers keep the same guarantees, and the same methods (this class): a step is committed
whole or not at all, whatever kills the run and when; a damaged step is set aside (into
`<dir>_damaged/`, never deleted) and the next older one is restored; a checkpoint whose tree
does not fit what the run expects is a config error, not damage, and nothing is moved; each
step records its fingerprints (jaxtrain/fingerprints.py: every floating leaf's sum of
squares, every numeric leaf's sum of bits), which train/restore_check.py checks the
restored arrays against, on any mesh. Rotation is a policy object
(jaxtrain/rotation.HealthyRotation): `keep` counts only checkpoints known to be healthy (the
run was training normally at or after that step: finite loss, no skipped step), so a
checkpoint of a broken state never pushes the last good one out.
"""

from __future__ import annotations

from jaxtrain.checkpoint_local import LocalCheckpoints
from jaxtrain.checkpoint_remote import RemoteCheckpoints
from jaxtrain.checkpoint_tier import Checkpoints, describe_mismatch
from jaxtrain.errors import CheckpointError

# Re-exported: the fingerprints were defined here before they had a module of their own.
from jaxtrain.fingerprints import file_checksum, tree_bits, tree_signature, tree_sums

__all__ = ["CheckpointError", "Checkpoints", "LocalCheckpoints", "RemoteCheckpoints",
           "describe_mismatch", "file_checksum", "tree_bits", "tree_signature", "tree_sums"]
