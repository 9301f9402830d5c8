"""configs/tiny_moe.py against the dense model of the same active parameters, same steps.

    python scripts/moe_tiny_compare.py [--steps 500] [--workdir /tmp/moe_compare] [--reuse]

Trains both with `python -m jaxtrain.main` (one after the other, the same data order) and
prints each evaluation's val_loss, the last logged train loss, total and active parameters,
and the MoE run's routing metrics at the end. The dense model is tiny_moe with
model.moe.num_experts=0: a SwiGLU of model.mlp_dim=512 per layer, as many weights as the
two experts of width 256 a token uses.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {"moe (8 experts × 256, top-2)": [],
            "dense (mlp 512, same active)": ["--config.model.moe.num_experts=0"]}


def train(workdir: pathlib.Path, extra: list[str], steps: int, reuse: bool) -> list[dict]:
    metrics = workdir / "metrics.jsonl"
    if reuse and metrics.exists():  # a finished run of the same command (WORKDIR/0, /1)
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    if workdir.exists():
        shutil.rmtree(workdir)
    subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config",
                    str(ROOT / "configs" / "tiny_moe.py"), "--workdir", str(workdir),
                    f"--config.steps={steps}", *extra], cwd=ROOT, check=True)
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def params(extra: list[str]) -> tuple[int, int]:
    """(total parameters, matmul weights a token uses)."""
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from jaxtrain.config import apply_overrides, load_config_file
    from jaxtrain.models import ModelSpec, Transformer
    from jaxtrain.models.flops import matmul_params

    cfg = load_config_file(ROOT / "configs" / "tiny_moe.py")
    apply_overrides(cfg, {a.split("=")[0][len("--config."):]: int(a.split("=")[1])
                          for a in extra})
    spec = ModelSpec.from_config(cfg)
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return total, matmul_params(spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--workdir", default="/tmp/moe_compare")
    p.add_argument("--reuse", action="store_true",
                   help="report runs already in WORKDIR/0 (moe) and WORKDIR/1 (dense)")
    a = p.parse_args()
    rows = {}
    for i, (name, extra) in enumerate(VARIANTS.items()):
        run = train(pathlib.Path(a.workdir) / str(i), extra, a.steps, a.reuse)
        rows[name] = (run, params(extra))
    evals = sorted({r["step"] for rs, _ in rows.values() for r in rs if "val_loss" in r})
    print("| model | params (total / active matmul) | "
          + " | ".join(f"val loss @{s}" for s in evals) + " | last train loss |")
    print("|---|---|" + "---|" * (len(evals) + 1))
    for name, (rs, (total, active)) in rows.items():
        val = {r["step"]: r["val_loss"] for r in rs if "val_loss" in r}
        train_loss = [r["loss"] for r in rs if "loss" in r][-1]
        print(f"| {name} | {total / 1e6:.2f}M / {active / 1e6:.2f}M | "
              + " | ".join(f"{val[s]:.4f}" for s in evals) + f" | {train_loss:.4f} |")
    last = [r for r in rows[next(iter(VARIANTS))][0] if "moe_aux_loss" in r][-1]
    print("\nMoE routing at the last logged step: " + ", ".join(
        f"{k} {last[k]:.4g}" for k in sorted(last) if k.startswith("moe_")))


if __name__ == "__main__":
    main()
