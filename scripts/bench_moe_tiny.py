"""Tiny MoE models against each other at the same active parameters, same steps.

    python scripts/bench_moe_tiny.py [--set mixtral|deepseek] [--steps 500]
                                       [--workdir /tmp/moe_compare] [--reuse]

--set mixtral (default): configs/tiny_moe.py against the dense model of the same active
parameters (tiny_moe with model.moe.num_experts=0: a SwiGLU of model.mlp_dim=512 per layer,
as many weights as the two experts of width 256 a token uses).
--set deepseek: configs/tiny_deepseek.py (latent attention, a dense first layer, 16 experts
of 128 with 3 routed and 1 shared, the sigmoid router balanced by its correction bias)
against the same model balanced by the aux loss instead (γ 0, aux weight 0.01) and against
configs/tiny_moe.py (Mixtral-style); each token's expert width is 512 in all three.

Trains each with `python -m jaxtrain.main` (one after the other, the same data order) and
prints each evaluation's val_loss, the last logged train loss, total and active parameters,
the median logged tokens/s, and the expert load balance over training (the busiest expert's
load over the mean, worst layer: moe_load_max) at every 100 steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETS = {
    "mixtral": {"moe (8 experts × 256, top-2)": ("tiny_moe.py", []),
                "dense (mlp 512, same active)": ("tiny_moe.py",
                                                 ["--config.model.moe.num_experts=0"])},
    "deepseek": {
        "deepseek-style, bias balancing (γ 0.001)": ("tiny_deepseek.py", []),
        "deepseek-style, aux loss 0.01 (γ 0)": (
            "tiny_deepseek.py", ["--config.model.moe.bias_update_rate=0.0",
                                 "--config.model.moe.aux_loss_weight=0.01"]),
        "mixtral-style (8 × 256, top-2)": ("tiny_moe.py", []),
        "deepseek-style, bias balancing (γ 0.01)": (
            "tiny_deepseek.py", ["--config.model.moe.bias_update_rate=0.01"])},
}


def train(workdir: pathlib.Path, config: str, extra: list[str], steps: int,
          reuse: bool) -> list[dict]:
    metrics = workdir / "metrics.jsonl"
    if reuse and metrics.exists():  # a finished run of the same command (WORKDIR/0, /1)
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    if workdir.exists():
        shutil.rmtree(workdir)
    subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config",
                    str(ROOT / "configs" / config), "--workdir", str(workdir),
                    f"--config.steps={steps}", *extra], cwd=ROOT, check=True)
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def params(config: str, extra: list[str]) -> tuple[int, int]:
    """(total parameters, matmul weights a token uses)."""
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from jaxtrain.config import apply_overrides, load_config_file
    from jaxtrain.models import ModelSpec, Transformer
    from jaxtrain.models.flops import matmul_params

    cfg = load_config_file(ROOT / "configs" / config)
    apply_overrides(cfg, {a.split("=")[0][len("--config."):]: type(_get(cfg, a))(
        a.split("=")[1]) for a in extra})
    spec = ModelSpec.from_config(cfg)
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return total, matmul_params(spec)


def _get(cfg, arg: str):
    value = cfg
    for part in arg.split("=")[0][len("--config."):].split("."):
        value = value[part]
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=SETS, default="mixtral")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--workdir", default="/tmp/moe_compare")
    p.add_argument("--reuse", action="store_true",
                   help="report runs already in WORKDIR/0, WORKDIR/1, ...")
    a = p.parse_args()
    variants, rows = SETS[a.set], {}
    for i, (name, (config, extra)) in enumerate(variants.items()):
        run = train(pathlib.Path(a.workdir) / str(i), config, extra, a.steps, a.reuse)
        rows[name] = (run, params(config, extra))
    evals = sorted({r["step"] for rs, _ in rows.values() for r in rs if "val_loss" in r})
    print("| model | params (total / active matmul) | "
          + " | ".join(f"val loss @{s}" for s in evals) + " | last train loss |")
    print("|---|---|" + "---|" * (len(evals) + 1))
    for name, (rs, (total, active)) in rows.items():
        val = {r["step"]: r["val_loss"] for r in rs if "val_loss" in r}
        train_loss = [r["loss"] for r in rs if "loss" in r][-1]
        print(f"| {name} | {total / 1e6:.2f}M / {active / 1e6:.2f}M | "
              + " | ".join(f"{val[s]:.4f}" for s in evals) + f" | {train_loss:.4f} |")
    print("\n| model | tokens/s (median) | " + " | ".join(
        f"load max/mean @{s}" for s in range(100, a.steps + 1, 100)) + " |")
    print("|---|---|" + "---|" * len(range(100, a.steps + 1, 100)))
    for name, (rs, _) in rows.items():
        tps = sorted(r["tokens_per_s"] for r in rs if "tokens_per_s" in r)
        load = {r["step"]: r.get("moe_load_max", float("nan")) for r in rs if "loss" in r}
        print(f"| {name} | {tps[len(tps) // 2]:,.0f} | " + " | ".join(
            f"{load.get(s, float('nan')):.2f}" for s in range(100, a.steps + 1, 100)) + " |")
    for name, (rs, _) in rows.items():
        last = [r for r in rs if "moe_aux_loss" in r][-1:]
        if last:
            print(f"\n{name}, routing at the last logged step: " + ", ".join(
                f"{k} {last[0][k]:.4g}" for k in sorted(last[0]) if k.startswith("moe_")))


if __name__ == "__main__":
    main()
