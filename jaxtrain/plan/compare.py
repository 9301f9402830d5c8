"""--compare: one config on several offers (hardware × device count), each on its fastest
layout that fits, ranked by time and by cost; a table and a plot.

Each offer tries the config's own layout and FSDP × tensor parallelism (tensor 1..8 inside a
node) under the config's remat policy and full remat: a few plans an offer, where --search
enumerates thousands (minutes a 256-device offer); run --search on the winner to refine it.
"""

from __future__ import annotations

from jaxtrain import hardware as catalog
from jaxtrain.config import ConfigError
from jaxtrain.hardware import HardwareError
from jaxtrain.plan.planner import make_plan
from jaxtrain.plan.search import ESTIMATE_ERROR, with_overrides


class CompareError(ValueError):
    """A malformed --compare list; the message is one line."""


def parse_offers(spec: str, devices: int | None, extra_file: str | None = None) -> list:
    """'H100-SXM:256,GB200:288,v7' -> [(Hardware, devices)]. An offer without ':N' takes
    --devices, else its TPU slice's chips."""
    offers = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        try:
            hw = catalog.get(name, extra_file)
        except HardwareError as e:
            valid = str(e).split("valid values are ", 1)[-1]
            raise CompareError(f"--compare={item} is invalid: unknown hardware {name!r}; "
                               f"valid values are {valid}") from None
        n = int(count) if count.isdigit() else devices or catalog.slice_devices(name)
        if not n or n < 1 or (count and not count.isdigit()):
            raise CompareError(f"--compare={item} is invalid: give NAME:DEVICES with a positive"
                               " count, or --devices for all offers")
        offers.append((hw, n))
    if len(offers) < 2:
        raise CompareError(f"--compare={spec} is invalid: give two or more offers, "
                           "comma-separated NAME[:DEVICES]")
    return offers


def _layouts(cfg, devices: int, devices_per_node: int):
    """The config as given, then fsdp × tensor (tensor inside a node) × two remat policies."""
    yield {}
    for tensor in (t for t in (1, 2, 4, 8) if t <= min(devices_per_node, devices)):
        if devices % tensor:
            continue
        for remat in dict.fromkeys((cfg.model.remat, "full")):
            yield {"mesh.data": 1, "mesh.fsdp": devices // tensor, "mesh.tensor": tensor,
                   "mesh.pipeline": 1, "mesh.expert": 1, "mesh.context": 1,
                   "mesh.sequence_parallel": tensor > 1, "model.remat": remat}


def best_plan(cfg, hw, devices: int, **plan_args) -> dict | None:
    """The fastest of _layouts whose estimate fits with the search's margin, or None."""
    best = None
    for overrides in _layouts(cfg, devices, hw.devices_per_node):
        try:
            plan = make_plan(with_overrides(cfg, overrides) if overrides else cfg, hw,
                             devices, **plan_args)
        except (ConfigError, HardwareError):
            continue
        mem = plan["memory"]
        if mem["total_bytes_per_device"] * ESTIMATE_ERROR > mem["usable_bytes"]:
            continue
        plan["overrides"] = overrides
        if best is None or plan["time"]["step_s"] < best["time"]["step_s"]:
            best = plan
    return best


def compare(cfg, offers: list, **plan_args) -> list[dict]:
    """One row per offer: its best plan (None where nothing fits) and its ranks by time
    and by cloud cost (1 = best; offers that fit nothing, or have no price, rank last)."""
    rows = [{"hardware": hw.name, "devices": n, "plan": best_plan(cfg, hw, n, **plan_args)}
            for hw, n in offers]
    inf = float("inf")

    def hours(r):
        return r["plan"]["time"].get("train_hours", r["plan"]["time"]["step_s"]) \
            if r["plan"] else inf

    def usd(r):
        cost = r["plan"] and r["plan"].get("cost", {}).get("cloud_usd")
        return inf if cost is None else cost

    # Ties (same hardware figures, e.g. H100 and H200 compute-bound) go to the other key.
    for key, name in (((hours, usd), "rank_time"), ((usd, hours), "rank_cost")):
        for rank, row in enumerate(sorted(rows, key=lambda r: (key[0](r), key[1](r))), 1):
            row[name] = rank
    return sorted(rows, key=lambda r: r["rank_cost"])


def _mesh(plan: dict) -> str:
    """The mesh axes above 1 and the remat policy the offer's best layout uses."""
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1) or "1 device"
    remat = plan["overrides"].get("model.remat")
    return mesh + (f" remat={remat}" if remat else "")


def _row_cells(row: dict) -> list[str]:
    offer = f"{row['devices']} × {row['hardware']}"
    plan = row["plan"]
    if plan is None:
        return [str(row["rank_cost"]), str(row["rank_time"]), offer, "nothing fits"] + \
            ["–"] * 7
    t, cost = plan["time"], plan.get("cost", {})
    days = f"{t['train_days']:,.1f}" if "train_days" in t else "–"
    usd = cost.get("cloud_usd")
    price = cost.get("cloud_usd_per_hour")
    calibrated = _calibration(plan["time"]["calibration"])
    return [str(row["rank_cost"]), str(row["rank_time"]), offer, _mesh(plan),
            f"{plan['memory']['total_bytes_per_device'] / 1e9:,.1f} GB",
            f"{t['step_s']:.2f} s", f"{t['mfu']:.1%}", f"{t['tokens_per_s']:,.0f}", days,
            "n/a (no list price)" if usd is None else f"${usd:,.0f} (${price:,.0f}/h)",
            calibrated]


def _calibration(text: str) -> str:
    """'±13% on 8 published runs of the H100 family (…)' -> '±13% (H100 runs)'; the
    uncalibrated statement -> 'uncalibrated (H100 parameters)'."""
    if text.startswith("uncalibrated"):
        family = text.split(": ", 1)[1].split(" parameters", 1)[0]
        return f"uncalibrated ({family} parameters)"
    error, _, rest = text.partition(" on ")
    return f"{error} ({rest.split(' of the ', 1)[-1].split(' family', 1)[0]} runs)"


HEADER = ["by cost", "by time", "offer", "mesh", "memory/device", "step", "MFU", "tokens/s",
          "days", "cloud $", "time model"]


def format_table(cfg_name: str, rows: list[dict]) -> str:
    """The comparison as a markdown table, ranked by cost (rank by time beside it)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_row_cells(r)) + " |" for r in rows]
    return f"{cfg_name}: the fastest layout that fits on each offer\n" + "\n".join(lines)
