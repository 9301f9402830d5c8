"""Fit the planner's time model on published training runs and report how well it predicts.

    python -m jaxtrain.plan.calibrate.fit_planner            # fit, leave-one-out, table
    python -m jaxtrain.plan.calibrate.fit_planner --write    # also write plan/calibration.json
    python -m jaxtrain.plan.calibrate.fit_planner --markdown # the table for docs/planner.md

Runs: jaxtrain/plan/published_runs.json (plan/published.py turns each into a config and its
published tokens/s per device). Parameters (plan/calibration.py): one matmul efficiency per
hardware family; the width knee, attention speed, link efficiencies, collective latency and
the two overlap fractions shared by all. The fit minimises the squared log error of the
predicted tokens/s (equivalently MFU), with a steep extra cost beyond ±12% so that no run
is left far outside; leave-one-out refits without each run and predicts it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
from scipy import optimize

from jaxtrain.plan import calibration, published

# hardware family -> catalog entries it covers (H200: the H100's compute and links)
FAMILIES = {"A100": ["A100-40GB", "A100-80GB"], "H100": ["H100-SXM", "H200"],
            "TPU-v4": ["TPU-v4"], "TPU-v5e": ["TPU-v5e"], "TPU-v5p": ["TPU-v5p"],
            "TPU-v6e": ["TPU-v6e"], "Blackwell": ["B200", "GB200", "B300", "GB300"]}
DEFAULT_FAMILY = "H100"  # for hardware without published runs (marked uncalibrated)
# Hardware without published runs whose nearest fitted family is not the default: TPU7x is
# a TPU (compiler, 3D torus, v5p's 1,200 GB/s ICI), not a GPU. Still marked uncalibrated.
NEAREST = {"TPU-v7": "TPU-v5p"}
# name: (start, low, high)
SHARED = {"width_knee": (500.0, 0.0, 5000.0), "attention_speed": (0.7, 0.2, 1.0),
          "intra_link_efficiency": (0.8, 0.2, 3.0), "inter_link_efficiency": (0.8, 0.2, 3.0),
          "collective_latency_s": (1e-5, 0.0, 2e-4), "overlap": (0.8, 0.0, 1.0),
          "tensor_overlap": (0.3, 0.0, 1.0),
          # Pinned by the fp8 runs alone (bf16 runs have no low-precision matmuls).
          "low_precision_efficiency": (0.8, 0.3, 1.5)}
EFFICIENCY = (0.7, 0.3, 1.0)
TOLERANCE = 0.12  # beyond this log error the cost grows steeply


def family(run: dict) -> str:
    return next(f for f, names in FAMILIES.items() if run["hardware"] in names)


def unpack(x, families) -> dict:
    shared = dict(zip(SHARED, x[:len(SHARED)]))
    return {"shared": shared, "families": dict(zip(families, x[len(SHARED):]))}


def cal_of(params: dict, fam: str):
    return calibration.from_params(fam, {**params["shared"],
                                         "matmul_efficiency": params["families"][fam]})


def log_errors(params: dict, runs) -> np.ndarray:
    return np.array([math.log(published.predicted_tokens_per_s(r, cal_of(params, family(r)))
                              / published.published_tokens_per_s(r)) for r in runs])


def fit(runs) -> dict:
    families = sorted({family(r) for r in runs})
    x0 = [v[0] for v in SHARED.values()] + [EFFICIENCY[0]] * len(families)
    low = [v[1] for v in SHARED.values()] + [EFFICIENCY[1]] * len(families)
    high = [v[2] for v in SHARED.values()] + [EFFICIENCY[2]] * len(families)
    scale = np.array(high) - np.array(low)

    def residuals(z):
        e = log_errors(unpack(np.array(low) + z * scale, families), runs)
        return np.concatenate([e, 5 * np.maximum(np.abs(e) - TOLERANCE, 0)])

    z0 = (np.array(x0) - np.array(low)) / scale
    best = optimize.least_squares(residuals, z0, bounds=(0, 1), x_scale=0.1)
    return unpack(np.array(low) + best.x * scale, families)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--no-loo", action="store_true", help="skip leave-one-out")
    args = parser.parse_args(argv)
    runs = [r for r in published.runs() if not r.get("held_out")]
    held_out = [r for r in published.runs() if r.get("held_out")]
    params = fit(runs)
    in_sample = dict(zip((r["id"] for r in runs), np.expm1(log_errors(params, runs))))
    loo = {}
    if not args.no_loo:
        for i, run in enumerate(runs):
            rest = runs[:i] + runs[i + 1:]
            p = fit(rest)
            if family(run) not in p["families"]:  # the only run of its family
                p["families"][family(run)] = float(np.median(list(p["families"].values())))
            loo[run["id"]] = float(np.expm1(log_errors(p, [run])[0]))
            print(f"loo {i + 1}/{len(runs)} {run['id']}: {loo[run['id']]:+.1%}",
                  file=sys.stderr)
    report(runs, params, in_sample, loo, args.markdown)
    held = dict(zip((r["id"] for r in held_out), np.expm1(log_errors(params, held_out))))
    report_held_out(held_out, held)
    if args.write:
        write(runs, params, in_sample, loo, held)


def report(runs, params, in_sample, loo, markdown: bool) -> None:
    print(json.dumps({"shared": params["shared"], "families": params["families"]}, indent=1))
    print("| run | hardware | devices | published tokens/s/device | predicted | error | "
          "leave-one-out |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        pub = published.published_tokens_per_s(r)
        pred = pub * (1 + in_sample[r["id"]])
        out = f"{loo[r['id']]:+.1%}" if r["id"] in loo else "–"
        print(f"| {r['id']} | {r['hardware']} | {r['devices']} | {pub:,.0f} | {pred:,.0f} | "
              f"{in_sample[r['id']]:+.1%} | {out} |")
    for fam in FAMILIES:
        ids = [r["id"] for r in runs if family(r) == fam]
        if ids:
            print(f"{fam}: {len(ids)} runs, max |error| "
                  f"{max(abs(in_sample[i]) for i in ids):.1%}" + (
                      f", leave-one-out {max(abs(loo[i]) for i in ids):.1%}" if loo else ""))
    del markdown


def report_held_out(runs, errors) -> None:
    """Runs left out of the fit (published_runs.json held_out), predicted by it."""
    print("| held-out run | hardware | devices | published tokens/s/device | predicted | "
          "error |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        pub = published.published_tokens_per_s(r)
        print(f"| {r['id']} | {r['hardware']} | {r['devices']} | {pub:,.0f} | "
              f"{pub * (1 + errors[r['id']]):,.0f} | {errors[r['id']]:+.1%} |")


def write(runs, params, in_sample, loo, held) -> None:
    families = {}
    for fam, names in FAMILIES.items():
        ids = [r["id"] for r in runs if family(r) == fam]
        if not ids:
            continue
        families[fam] = {
            "hardware": names, "params": {"matmul_efficiency": params["families"][fam]},
            "runs": len(ids), "max_error": max(abs(in_sample[i]) for i in ids),
            "loo_max_error": max(abs(loo[i]) for i in ids) if loo else None}
    doc = {"_about": "Written by jaxtrain/plan/calibrate/fit_planner.py from "
                     "jaxtrain/plan/published_runs.json; errors are |predicted/published - 1|"
                     " of tokens/s per device.",
           "default_family": DEFAULT_FAMILY, "nearest": NEAREST,
           "shared": params["shared"], "families": families,
           "held_out": {k: float(v) for k, v in held.items()}}
    with open(calibration.CALIBRATION_FILE, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
