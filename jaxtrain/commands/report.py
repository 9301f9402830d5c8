"""Draw a run as a PNG, with a short text summary:

    jaxtrain report --workdir RUN [--out RUN/report.png]

Panels: loss and val_loss, tokens/s, MFU, the step time split into waiting for data and
device work, goodput, and where the rest of the wall time went (start-up, checkpoints,
evaluation, data, restarts, recomputed steps), and downstream task scores (eval.tasks)
where the run has them, from RUN/metrics.jsonl. The summary names the peak MFU was divided
by (the newest session's first row records it) and the steps where MFU came out over 1
(left out of the rows: the peak was too low).
"""

from __future__ import annotations

import argparse
import io
import math
import pathlib
import sys

from jaxtrain import storage
from jaxtrain.commands.common import exit_usage
from jaxtrain.errors import ConfigError
from jaxtrain.metrics_log import location, read_metrics
from jaxtrain.train.goodput import LOST
from jaxtrain.workdir import REPORT_FILE

TASK_PREFIX = "tasks/"


def load_rows(workdir: pathlib.Path) -> list[dict]:
    path = location(workdir)  # metrics.jsonl, or the segments on object storage
    if not path.exists():
        exit_usage(f"{path} does not exist; is --workdir a jaxtrain run?")
    return read_metrics(workdir, say=lambda message: print(message, file=sys.stderr))


def series(rows, key):
    points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def task_keys(rows) -> list[str]:
    """The downstream task scores a run logged (tasks/TASK/METRIC), in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith(TASK_PREFIX)))


def summary(rows: list[dict]) -> str:
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    steady = train[1:] or train
    lines = [f"steps logged: {len(train)}, last step {rows[-1]['step'] if rows else 0}"]
    if train:
        lines.append(f"loss: first {train[0]['loss']:.4f}, last {train[-1]['loss']:.4f}")
        mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
        lines.append(f"tokens/s: {mean('tokens_per_s'):.4g} (mean after the first log), "
                     f"{_mfu_text(steady)}, step {mean('step_time_s'):.4g}s")
        lines.extend(_peak_lines(rows))
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
    for key in task_keys(rows):
        _, values = series(rows, key)
        lines.append(f"{key[len(TASK_PREFIX):]}: first {values[0]:.4g}, last {values[-1]:.4g}")
    good = [r for r in rows if "goodput" in r]
    if good:
        last = good[-1]
        lost = ", ".join(f"{cause} {last[f'lost_{cause}_s']:.4g}s" for cause in LOST
                         if last.get(f"lost_{cause}_s"))
        idle = last.get("idle_s", 0.0)
        apart = f" less {idle:.4g}s idle after deliberate stops" if idle else ""
        lines.append(f"goodput: {last['goodput']:.1%} of {last['wall_s'] - idle:.4g}s (the "
                     f"{last['wall_s']:.4g}s since the job first started{apart}); lost: "
                     f"{lost or 'nothing'}")
    return "\n".join(lines)


def _mfu_text(steady: list[dict]) -> str:
    """The mean MFU of the rows that have one (a row whose MFU came out over 1 leaves it
    out: its peak is suspect, train/step_log.py)."""
    mfus = [r["mfu"] for r in steady if isinstance(r.get("mfu"), (int, float))]
    return f"MFU {sum(mfus) / len(mfus):.3f}" if mfus else "MFU n/a"


def _peak_lines(rows: list[dict]) -> list[str]:
    """The peak MFU divided by (the newest session's), and the rows where it was suspect."""
    peaks = [r for r in rows if "peak_flops_per_device" in r]
    lines = []
    if peaks:
        peak = peaks[-1]
        lines.append(f"MFU peak: {peak['peak_flops_per_device'] / 1e12:.4g} TFLOP/s per "
                     f"device ({peak.get('peak_source') or 'source unknown'})")
    suspect = [r["step"] for r in rows if r.get("mfu_peak_suspect")]
    if suspect:
        lines.append(f"MFU over 1 at {len(suspect)} logged step(s) (first {suspect[0]}), left "
                     "out: the peak is too low for this run, e.g. measured on a busy machine")
    return lines


def draw(rows: list[dict], out: pathlib.Path, title: str) -> None:
    import matplotlib  # heavy, and only this command draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = task_keys(rows)
    height = 4 if tasks else 3
    fig, axes = plt.subplots(height, 2, figsize=(11, 10 * height / 3), constrained_layout=True)
    _draw_training(axes, rows)
    _draw_goodput(axes[2], rows)
    if tasks:
        _draw_tasks(axes[3], rows, tasks)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    buffer = io.BytesIO()  # one write of the whole PNG: a file renamed, or one upload
    fig.savefig(buffer, format="png", dpi=100)
    storage.atomic_write(out, buffer.getvalue())
    plt.close(fig)


def _draw_training(axes, rows: list[dict]) -> None:
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


def _draw_goodput(axes, rows: list[dict]) -> None:
    """Goodput over the run, and the wall time lost by cause (cumulative, since the job
    first started)."""
    axes[0].plot(*series(rows, "goodput"))
    axes[0].set_ylim(0, 1)
    axes[0].set_title("goodput (productive share of wall time)")
    good = [r for r in rows if "goodput" in r]
    causes = [c for c in LOST if any(r.get(f"lost_{c}_s") for r in good)]
    if good and causes:
        axes[1].stackplot([r["step"] for r in good],
                          *[[r.get(f"lost_{c}_s", 0.0) for r in good] for c in causes],
                          labels=causes)
        axes[1].legend(loc="upper left", fontsize="small")
    axes[1].set_title("wall time lost, by cause (s)")


def _draw_tasks(axes, rows: list[dict], keys: list[str]) -> None:
    """Downstream task scores over the run: accuracies and the like in one panel, anything
    outside [0, 1] (perplexities, bits) in the other."""
    unit = [k for k in keys if all(0 <= v <= 1 for v in series(rows, k)[1])]
    for ax, chosen, title in ((axes[0], unit, "downstream tasks"),
                              (axes[1], [k for k in keys if k not in unit],
                               "downstream tasks (other scales)")):
        for key in chosen:
            ax.plot(*series(rows, key), "o-", label=key[len(TASK_PREFIX):])
        ax.set_title(title)
        if chosen:
            ax.legend(loc="best", fontsize="small")
        elif ax is axes[1]:
            ax.set_visible(False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="jaxtrain report",
                                     description="Draw a jaxtrain run as a PNG.")
    parser.add_argument("--workdir", required=True, help="the run directory")
    parser.add_argument("--out", help="the PNG to write (default WORKDIR/report.png)")
    args = parser.parse_args(argv)
    try:
        storage.check_path(args.workdir, "--workdir")
        storage.check_path(args.out or "", "--out")
    except ConfigError as e:
        exit_usage(str(e))
    workdir = storage.as_path(args.workdir, "--workdir")
    rows = load_rows(workdir)
    out = storage.as_path(args.out, "--out") if args.out else workdir / REPORT_FILE
    storage.make_parent(out)
    draw(rows, out, str(workdir))
    print(summary(rows))
    print(f"drawn: {out}")


if __name__ == "__main__":
    main()
