"""Data: sources, tokenizers, prepared datasets, the grain pipeline.

Runtime input (sources, batches, packing, the prepared source) and what the offline
preparation (jaxtrain.prepare) shares with it: the dataset format, fingerprints, tokenizers.
The names below load lazily, so that jaxtrain.prepare and its spawned workers, which import
modules of this package, do not import jax and grain, which they never use
(tests/unit/test_architecture.py checks it).
"""

import importlib

__all__ = ["Batches", "DataError", "SOURCES", "make_batches", "to_global"]

_WHERE = {"Batches": "jaxtrain.data.batches", "make_batches": "jaxtrain.data.batches",
          "to_global": "jaxtrain.data.batches", "SOURCES": "jaxtrain.data.sources",
          "DataError": "jaxtrain.errors"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'jaxtrain.data' has no attribute {name!r}")
