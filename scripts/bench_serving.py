"""The float32 model of a run next to its int8 versions: size, validation loss, decode speed.

    python scripts/bench_serving.py --workdir runs/tiny [--new_tokens 100] [--markdown]

Quantizes the run's newest checkpoint twice (int8 weights; int8 weights and activations),
then for each model measures the checkpoint size on disk, the validation loss (as
`jaxtrain eval`) and greedy decode tokens/s with the KV cache (as `jaxtrain generate`: one
prompt, compile excluded, best of 3). Sizes: the run's own checkpoint holds the Adam moments
too, so the float32 parameters alone are also given.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import numpy as np

from jaxtrain import inference
from jaxtrain.commands.quantize import quantize_run
from jaxtrain.engine import Engine, Model, Request, SamplingParams
from jaxtrain.quantization import directory_bytes


def decode_rate(loaded, new_tokens: int, prompt: list[int]) -> float:
    """Greedy tokens/s of one prompt on the generation engine (one slot; compile excluded:
    a first run compiles, the best of 3 more is timed)."""
    engine = Engine(Model.of(loaded), slots=1)
    request = Request(tuple(prompt), SamplingParams(max_new_tokens=new_tokens,
                                                    ignore_eos=True))
    engine.generate([request])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        engine.generate([request])
        best = min(best, time.perf_counter() - start)
    return new_tokens / best


def measure(workdir: pathlib.Path, new_tokens: int) -> dict:
    loaded = inference.load(workdir)
    _, windows, _ = inference.evaluation_windows(loaded.cfg, None)
    loss = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)["loss"]
    step = loaded.step
    return {"checkpoint_bytes": directory_bytes(workdir / "checkpoints" / str(step)),
            "val_loss": loss, "decode_tokens_per_s": decode_rate(loaded, new_tokens,
                                                                 list(b"def main("))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=pathlib.Path)
    parser.add_argument("--new_tokens", type=int, default=100)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    float_loaded = inference.load(args.workdir)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(float_loaded.params))
    rows = {"float32": measure(args.workdir, args.new_tokens)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, activations in (("int8 weights", False), ("int8 weights + activations",
                                                             True)):
            out = pathlib.Path(tmp) / name.replace(" ", "_").replace("+", "and")
            quantize_run(args.workdir, out, calibration_batches=8,
                         int8_activations=activations)
            rows[name] = measure(out, args.new_tokens)
    base = rows["float32"]
    if not args.markdown:
        print(json.dumps({"float32_param_bytes": param_bytes, **rows}))
        return
    print(f"float32 parameters alone: {param_bytes / 1e6:.2f} MB\n")
    print("| model | checkpoint on disk | × float32 params | val loss | Δ loss | "
          "decode tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        note = " (with Adam moments)" if name == "float32" else ""
        print(f"| {name} | {row['checkpoint_bytes'] / 1e6:.2f} MB{note} | "
              f"{row['checkpoint_bytes'] / param_bytes:.3f} | {row['val_loss']:.4f} | "
              f"{row['val_loss'] / base['val_loss'] - 1:+.3%} | "
              f"{row['decode_tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
