"""jaxtrain: train decoder-only language models with JAX/Flax on any device mesh."""

__version__ = "0.1.0"
