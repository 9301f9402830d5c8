from jaxtrain.data.pipeline import DataError, Batches, make_batches

__all__ = ["Batches", "DataError", "make_batches"]
