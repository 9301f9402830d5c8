"""Fit the memory estimate's factors (plan/memory.py Factors) on the compiled steps stored in
plan/memory_fit.json, one set per compiler.

    python -m jaxtrain.plan.calibrate.fit_memory [--source cpu|tpu] [--fit] [--write]
        [--markdown]
    python -m jaxtrain.plan.calibrate.fit_memory --holdout K [--source cpu|tpu]   # CV

The stored rows come from memory_check --update (XLA:CPU: the test grid, the shipped
configs, the published layouts) and tpu_aot_check --plan ... --update
(libtpu's TPU compiles). The fit minimises the worst rows (Nelder–Mead on a soft maximum of
the log errors, each in units of the ±15% bound on its side, from the current factors and
two seeded random starts), where an estimate under the compiler counts 1.1× as bad as one
as far over it: the planner must not promise a fit that fails. Prints each row's estimate /
XLA; exit code 1 when any row is outside ±15% (memory.TARGET).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np
from scipy.optimize import minimize

from jaxtrain.plan import memory, memory_fit

# The range each factor is searched in.
BOUNDS = {
    "temp_margin": (0.0, 0.6),
    "chunk_scores": (0.0, 4.0),
    "chunk_scores_per_chunk": (0.0, 3.0),
    "loop_tiles": (0.0, 32.0),
    "full_working": (0.0, 2.0),
    "dots_working": (0.0, 2.0),
    "grad_working": (0.0, 2.0),
    "head_stream": (0.0, 8.0),
    "rope_f32": (0.0, 12.0),
    "peak_margin": (0.0, 1.0),
    "logit_f32": (0.0, 4.0),
    "head_copies": (0.5, 4.0),
    "layer_weights": (0.0, 4.0),
    "layer_weight_grads": (0.0, 2.0),
    "phase_overlap": (0.0, 1.0),
    "pipeline_weight_copies": (0.0, 12.0),
    "moe_row_factor": (0.5, 4.0),
    "moe_working_factor": (0.5, 4.0),
}
# An estimate under the compiler counts this much worse than one as far over it, both
# measured against the target's bound on their side (memory.TARGET): the planner must not
# promise a fit that fails.
UNDER_WEIGHT = 1.1
STARTS = 3  # the current factors, then random points of BOUNDS (seeded)


def badness(ratio: float) -> float:
    """log(ratio) in units of the target's bound on its side: 1 at either bound."""
    err = math.log(ratio)
    if err < 0:
        return UNDER_WEIGHT * err / math.log(memory.TARGET[0])
    return err / math.log(memory.TARGET[1])


def fit(rows: list[dict], start: memory.Factors, fallback: memory.Factors) -> memory.Factors:
    """Nelder–Mead on a soft maximum (the 16-norm) of the rows' badness: the worst rows
    dominate, and the objective stays smooth enough to descend. Factors the rows do not
    exercise (no pipeline or MoE among the TPU rows) take fallback's values (the CPU set's)
    rather than drift to a bound."""
    configs = [memory_fit.config_of(r) for r in rows]

    def estimates(k: memory.Factors) -> list[float]:
        return [memory_fit.estimate(r, k, c) for r, c in zip(rows, configs)]

    # Whether a factor moves any row is asked mid-range, where every term counts (at the
    # start a factor can hide another: with no phase overlap, the smaller phase's factors
    # would look unused and stay at fallback's values).
    probe = dataclasses.replace(start, **{n: sum(b) / 2 for n, b in BOUNDS.items()})
    base = estimates(probe)
    names = [n for n in BOUNDS
             if estimates(dataclasses.replace(probe, **{n: getattr(probe, n) + 0.5})) != base]
    start = dataclasses.replace(start, **{n: getattr(fallback, n) for n in BOUNDS
                                          if n not in names})
    lo, hi = (np.array([BOUNDS[n][i] for n in names]) for i in (0, 1))

    def factors(x) -> memory.Factors:
        return dataclasses.replace(start, **dict(zip(names, np.clip(x, lo, hi).tolist())))

    def objective(x) -> float:
        k = factors(x)
        bad = [badness(memory_fit.estimate(r, k, c) / r["compiled_bytes"])
               for r, c in zip(rows, configs)]
        return (sum(b ** 16 for b in bad) / len(bad)) ** (1 / 16)

    rng = np.random.default_rng(0)
    best = None
    for trial in range(STARTS):  # from the start given, then seeded random points
        x0 = np.array([getattr(start, n) for n in names]) if trial == 0 \
            else lo + rng.random(len(names)) * (hi - lo) / 2
        res = minimize(objective, x0, method="Nelder-Mead",
                       options={"maxfev": 3000, "xatol": 1e-3, "fatol": 1e-5})
        if best is None or res.fun < best.fun:
            best = res
    return factors(best.x)


def report(rows: list[dict], k: memory.Factors, markdown: bool) -> tuple[list[str], list]:
    """Prints each row; returns those outside memory.TARGET, and the spread of estimate /
    XLA over the rows as memory.uncertainty reads it: [lowest, highest, rows]."""
    outside, ratios = [], []
    if markdown:
        print("| case | devices | estimate MiB | XLA compiled MiB | estimate / XLA |")
        print("|---|---|---|---|---|")
    for r in rows:
        est = memory_fit.estimate(r, k)
        ratio = est / r["compiled_bytes"]
        ratios.append(ratio)
        if not memory_fit.within(ratio):
            outside.append(f"{r['case']} {ratio:.2f}")
        if markdown:
            print(f"| {r['case']} | {r['devices']} | {est / 2**20:,.0f} | "
                  f"{r['compiled_bytes'] / 2**20:,.0f} | {ratio:.2f} |")
        else:
            print(f"{r['case']:48s} {r['devices']:3d} {ratio:6.3f}")
    return outside, memory_fit.spread(ratios, len(ratios))


def holdout(rows: list[dict], fallback: memory.Factors, folds: int) -> tuple[list, list]:
    """K-fold cross-validation: each row's estimate / XLA with factors fitted on the other
    folds only (row i in fold i mod K, rows in case order; each fit starts from the default
    factors, not from the stored ones, which have seen the held-out rows): how far the
    estimate can be trusted on a layout it was not fitted on. Returns the spread, each
    fold's factors and its rows' cases (stored, so that tests/unit/test_plan.py rechecks every
    held-out row, and a row added later is known to be in no fold)."""
    ratios, fold_factors, fold_cases = [], [], []
    for f in range(folds):
        train = [r for i, r in enumerate(rows) if i % folds != f]
        k = fit(train, memory.Factors(), fallback)
        fold_factors.append(dataclasses.asdict(k))
        fold_cases.append([r["case"] for r in rows[f::folds]])
        for r in rows[f::folds]:
            ratios.append(memory_fit.estimate(r, k) / r["compiled_bytes"])
            print(f"fold {f}: {r['case']:48s} {ratios[-1]:6.3f}", flush=True)
    inside = sum(memory_fit.within(x) for x in ratios)
    print(f"held out ({folds} folds): {min(ratios):.3f}–{max(ratios):.3f}, "
          f"{inside} of {len(ratios)} within ±15%")
    return memory_fit.spread(ratios, folds), fold_factors, fold_cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=("cpu", "tpu"), action="append")
    parser.add_argument("--fit", action="store_true", help="fit the factors (default: "
                        "report the rows with the stored ones)")
    parser.add_argument("--write", action="store_true", help="store the factors (with "
                        "--fit) and the rows' spread, or the held-out spread (with "
                        "--holdout): plans quote both")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--holdout", type=int, metavar="K", help="cross-validate the fit "
                        "over K folds of the rows instead (≈K× a fit's time)")
    args = parser.parse_args(argv)
    if args.holdout is not None and args.holdout < 2:
        parser.error(f"--holdout={args.holdout}: needs K ≥ 2 folds")
    data = memory_fit.load()
    outside = []
    for source in args.source or ("cpu", "tpu"):
        rows = memory_fit.cases(source)
        if not rows:
            continue
        k = memory.Factors(**data["factors"][source])
        fallback = memory.Factors(**data["factors"]["cpu"]) if source == "tpu" \
            else memory.Factors()
        if args.holdout:
            spread, fold_factors, fold_cases = holdout(rows, fallback, args.holdout)
            data.setdefault("holdout", {})[source] = spread
            data.setdefault("holdout_factors", {})[source] = fold_factors
            data.setdefault("holdout_cases", {})[source] = fold_cases
            continue
        if args.fit:
            k = fit(rows, k, fallback)
            # The stored held-out spread was of the factors this replaces: rerun --holdout.
            data.get("holdout", {}).pop(source, None)
            data.get("holdout_factors", {}).pop(source, None)
            data.get("holdout_cases", {}).pop(source, None)
        print(f"\n{source}: {len(rows)} compiled steps; factors {dataclasses.asdict(k)}")
        out, data.setdefault("spread", {})[source] = report(rows, k, args.markdown)
        outside += out
        data["factors"][source] = dataclasses.asdict(k)
    if args.write:
        memory_fit.write(data)
    print("\noutside ±15%: " + (", ".join(outside) or "none"))
    sys.exit(1 if outside else 0)


if __name__ == "__main__":
    main()
