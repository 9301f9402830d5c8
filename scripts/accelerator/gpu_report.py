"""The report of gpu_check.sh: each check's JSON row, and the measured llama_1b runs
next to the planner's prediction for the same run (step time, tokens/s, MFU, memory).

    python scripts/accelerator/gpu_report.py --results OUT/gpu_results.jsonl --out OUT
        [--hardware NAME] -- [--config.KEY=VALUE ...]   # the overrides the benchmarks ran with
    python scripts/accelerator/gpu_report.py --row NAME SECONDS FILE  # (gpu_check.sh) a row

Writes OUT/gpu_report.json and OUT/gpu_report.md; exits 1 when a check failed (skipped ones
are not failures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row(name: str, seconds: str, path: str) -> None:
    """The JSON line(s) a check printed, as one result row."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    if not lines:
        sys.exit(1)
    result = lines[-1] if len(lines) == 1 else {"rows": lines}
    print(json.dumps({**result, "check": name, "status": "ok", "seconds": int(seconds)}))


def _overrides(argv: list[str]) -> dict:
    out = {}
    for arg in argv:
        key, _, value = arg.removeprefix("--config.").partition("=")
        out[key] = json.loads(value) if value[:1].isdigit() or value[:1] == "-" else value
    return out


def prediction(bench: dict, hardware_name: str | None, overrides: dict) -> dict:
    """The planner's figures for the run a bench row measured."""
    sys.path.insert(0, ROOT)
    from jaxtrain import hardware
    from jaxtrain.config import validate
    from jaxtrain.plan import memory
    from jaxtrain.plan.compile_check import load_config
    from jaxtrain.plan.planner import make_plan

    cfg = load_config(os.path.join(ROOT, "configs/llama_1b.py"), {
        **overrides, "model.attention": bench["attention"],
        "train.precision": bench["precision"]})
    name = hardware_name or hardware.for_device_kind(bench["device_kind"])
    if name is None:
        return {"error": f"no catalog entry for {bench['device_kind']}"}
    try:
        plan = make_plan(cfg, hardware.get(name), bench["devices"])
    except hardware.HardwareError as e:  # e.g. no fp8 peak for a CPU
        return {"skipped": str(e)}
    backend = "cpu" if bench["device_kind"] == "cpu" else "accelerator"
    estimate = memory.estimate(cfg, validate(cfg, bench["devices"]), backend)["total"]
    t = plan["time"]
    return {"hardware": name, "step_s": t["step_s"], "tokens_per_s": t["tokens_per_s"],
            "mfu": t["mfu"], "memory_bytes": estimate, "uncertainty": t["calibration"],
            "step_ratio": bench["step_time_s"] / t["step_s"],
            "memory_ratio": estimate / bench["memory_total_bytes"]}


def markdown(rows: list[dict]) -> str:
    out = ["| check | status | s | result |", "|---|---|---|---|"]
    for r in rows:
        if r["check"].startswith("llama_1b") and r["status"] == "ok":
            p = r.get("planner", {})
            result = (f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_time_s']:.3f} s, MFU "
                      f"{r['mfu']:.1%}, XLA memory {r['memory_total_bytes'] / 2**30:.2f} GiB")
            if "step_s" in p:
                result += (f"; planner ({p['hardware']}): step {p['step_s']:.3f} s "
                           f"(measured/predicted {p['step_ratio']:.2f}), memory "
                           f"{p['memory_bytes'] / 2**30:.2f} GiB (estimate/XLA "
                           f"{p['memory_ratio']:.2f})")
            elif p:
                result += f"; planner: {p.get('skipped') or p.get('error')}"
        elif r["check"] == "matmul_peak" and r["status"] == "ok":
            result = ", ".join(f"{k.removesuffix('_tflops')} {v:.3g} TFLOP/s"
                               for k, v in r.items() if k.endswith("_tflops"))
        else:
            result = r.get("reason") or ", ".join(
                f"{k}={v}" for k, v in r.items()
                if k not in ("check", "status", "seconds", "rows", "stderr"))[:200]
            if "rows" in r:
                result = f"{len(r['rows'])} rows (gpu_report.json)"
        out.append(f"| {r['check']} | {r['status']} | {r.get('seconds', '')} | {result} |")
    fp8 = next((r for r in rows if r["check"].startswith("llama_1b fp8")), None)
    bf16 = next((r for r in rows if r["check"].startswith("llama_1b bf16")), None)
    if fp8 and bf16 and fp8["status"] == bf16["status"] == "ok":
        out.append(f"\nfp8 / bf16 tokens/s: {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}")
    return "\n".join(out) + "\n"


def report(args, overrides: dict) -> int:
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        if r["check"].startswith("llama_1b") and r["status"] == "ok":
            try:
                r["planner"] = prediction(r, args.hardware, overrides)
            except Exception as e:  # noqa: BLE001 - the report is written regardless
                r["planner"] = {"error": str(e)[:200]}
    with open(os.path.join(args.out, "gpu_report.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = markdown(rows)
    with open(os.path.join(args.out, "gpu_report.md"), "w") as f:
        f.write(text)
    print(text)
    failed = [r["check"] for r in rows if r["status"] == "error"
              or "error" in r.get("planner", {})]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main() -> None:
    if sys.argv[1:2] == ["--row"]:
        row(*sys.argv[2:5])
        return
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hardware", help="catalog entry (default: from the device kind)")
    sys.exit(report(parser.parse_args(argv), _overrides(extra)))


if __name__ == "__main__":
    main()
