"""Draw a run as a PNG, with a short text summary:

    python -m jaxtrain.report --workdir RUN [--out RUN/report.png]

Panels: loss and val_loss, tokens/s, MFU, and the step time split into waiting for data
and device work, all against the step, from RUN/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys


def load_rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        sys.exit(f"jaxtrain.report: error: {path} does not exist; is --workdir a jaxtrain run?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows, key):
    points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def summary(rows: list[dict]) -> str:
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    steady = train[1:] or train
    lines = [f"steps logged: {len(train)}, last step {rows[-1]['step'] if rows else 0}"]
    if train:
        lines.append(f"loss: first {train[0]['loss']:.4f}, last {train[-1]['loss']:.4f}")
        mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
        lines.append(f"tokens/s: {mean('tokens_per_s'):.4g} (mean after the first log), "
                     f"MFU {mean('mfu'):.3f}, step {mean('step_time_s'):.4g}s")
        if "data_wait_s" in steady[0]:
            waited = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
            lines.append(f"waiting for data: {waited:.1%} of step time")
        skipped = train[-1].get("skipped_steps", 0)
        if skipped:
            lines.append(f"skipped non-finite steps: {skipped}")
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        lines.append(f"val_loss: first {val[0]['val_loss']:.4f}, last {val[-1]['val_loss']:.4f}"
                     f", best {best['val_loss']:.4f} at step {best['step']}")
    return "\n".join(lines)


def draw(rows: list[dict], out: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(*series(rows, "loss"), label="loss")
    ax.plot(*series(rows, "val_loss"), "o-", label="val_loss")
    ax.set_title("loss")
    ax.legend()
    axes[0, 1].plot(*series(rows, "tokens_per_s"))
    axes[0, 1].set_title("tokens/s")
    axes[1, 0].plot(*series(rows, "mfu"))
    axes[1, 0].set_title("MFU")
    ax = axes[1, 1]
    steps, device = series(rows, "device_time_s")
    _, data = series(rows, "data_wait_s")
    if steps:
        ax.stackplot(steps, device, data, labels=["device", "waiting for data"])
        ax.legend(loc="upper right")
    ax.set_title("step time (s)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Draw a jaxtrain run as a PNG.")
    parser.add_argument("--workdir", required=True, type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, help="default WORKDIR/report.png")
    args = parser.parse_args(argv)
    rows = load_rows(args.workdir)
    out = args.out or args.workdir / "report.png"
    draw(rows, out, str(args.workdir))
    print(summary(rows))
    print(f"drawn: {out}")


if __name__ == "__main__":
    main()
