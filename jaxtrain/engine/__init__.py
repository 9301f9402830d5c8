"""The generation engine: batched ragged prompts, stops, log-probabilities, n samples per
prompt and continuous batching over a fixed-shape KV cache (engine/engine.py)."""

from jaxtrain.engine.engine import Engine
from jaxtrain.engine.requests import Completion, Request, SamplingParams
from jaxtrain.engine.steps import Model

__all__ = ["Completion", "Engine", "Model", "Request", "SamplingParams"]
