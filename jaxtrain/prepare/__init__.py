"""Offline data preparation (`jaxtrain prepare`): input files -> token shards.

pipeline (the run: plan the units, tokenize them in worker processes, write and publish the
shards), readers (input formats, cut into units), workers (the spawned tokenizing
processes), shards (staged shards and their report), merge (joining the parts of a
multi-machine prepare), remote (object-storage inputs and outputs).

None of it imports jax or grain: a prepare and each of its workers start in a fraction of a
second and hold no accelerator (tests/unit/test_architecture.py checks it). What training reads
back, the dataset format, fingerprints and tokenizers, lives in jaxtrain.data, which this
package imports and which never imports it.
"""
