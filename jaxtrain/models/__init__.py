from jaxtrain.models.transformer import ModelSpec, Transformer

__all__ = ["ModelSpec", "Transformer"]
