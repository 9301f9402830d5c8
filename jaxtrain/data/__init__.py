from jaxtrain.data.batches import Batches, make_batches, to_global
from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import DataError

__all__ = ["Batches", "DataError", "SOURCES", "make_batches", "to_global"]
