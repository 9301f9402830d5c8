"""Compare Hugging Face models with a jaxtrain run on the run's own validation batches.

    python scripts/compare_hf.py --workdir RUN --hf EXPORTED_DIR [--hf OTHER_DIR ...]

Prints the validation loss of the run's newest checkpoint (jaxtrain) and of each HF
model (transformers, float32), and the largest logit difference between each HF model and
the checkpoint. Needs torch and transformers (the `test` extra).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from jaxtrain.config import base_config
from jaxtrain.data.batches import make_batches
from jaxtrain.hf.save import load_for_export


def _loss(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--hf", action="append", required=True)
    a = p.parse_args()

    cfg = base_config()
    cfg.update(json.loads((pathlib.Path(a.workdir) / "config.json").read_text()))
    tokens = np.concatenate(make_batches(cfg).val_batches())
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    setup, params, step = load_for_export(a.workdir, jax.devices()[:1])
    with jax.set_mesh(setup.mesh):
        ours = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, inputs))
    print(f"validation: {inputs.shape[0]} sequences x {inputs.shape[1]} tokens")
    print(f"jaxtrain {a.workdir} step {step}: loss {_loss(ours, targets):.4f}")
    for directory in a.hf:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
        with torch.no_grad():
            theirs = model(torch.from_numpy(inputs)).logits.numpy()
        print(f"transformers {directory}: loss {_loss(theirs, targets):.4f}, "
              f"max |logit - jaxtrain's| {np.abs(theirs - ours).max():.2e}")


if __name__ == "__main__":
    main()
