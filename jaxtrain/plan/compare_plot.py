"""plan --compare --plot FILE.png: each offer's days to train against its cloud cost."""

from __future__ import annotations


def plot(cfg_name: str, rows: list[dict], path: str) -> None:
    """A scatter of days (or step seconds, without --tokens/--hours) against cloud $, one
    labelled point per offer that fits; unpriced offers on a strip at zero cost, marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fits = [r for r in rows if r["plan"] is not None]
    timed = all("train_days" in r["plan"]["time"] for r in fits)
    for row in fits:
        t, cost = row["plan"]["time"], row["plan"].get("cost", {})
        y = t["train_days"] if timed else t["step_s"]
        usd = cost.get("cloud_usd")
        x, marker = (usd, "o") if usd is not None else (0.0, "x")
        ax.scatter([x], [y], marker=marker, s=60)
        label = f"{row['devices']}× {row['hardware']}" + ("" if usd is not None else
                                                          " (no price)")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.xaxis.set_major_formatter(lambda v, _: f"${v / 1e6:,.2f}M")
    ax.set_xlabel("cloud cost (catalog list prices)")
    ax.set_ylabel("days to train" if timed else "step, s")
    ax.set_title(f"{cfg_name}: time and cost per offer (planner estimate)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
