"""jaxtrain plan --config configs/NAME.py --hardware NAME --devices N
       [--tokens T | --hours H] [--price-per-hour P] [--json] [--search [--by cost]]
       [--compile] [--config.KEY=VALUE ...]
jaxtrain plan --config configs/NAME.py --compare H100-SXM:256,GB200:256,v7:256
       [--tokens T] [--plot FILE.png] [--json]

The planner's flags and output (the planner itself is jaxtrain/plan/).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from jaxtrain.commands.common import OVERRIDES_HELP, exit_usage, run_absl
from jaxtrain.hardware import slice_devices  # no jax: safe before the fake devices are set
from jaxtrain.xla_flags import with_device_count

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file from configs/.",
                                          lock_config=True)
_HARDWARE = flags.DEFINE_string("hardware", None, "A catalog entry (jaxtrain/"
                                "hardware.json), e.g. A100-80GB, H100-SXM, v5p-128.")
_HARDWARE_FILE = flags.DEFINE_string("hardware-file", None, "A JSON file of extra or "
                                     "replacement catalog entries, same form.")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices (default: a TPU slice's chips).")
_TOKENS = flags.DEFINE_float("tokens", None, "Predict time and cost to train this many tokens.")
_HOURS = flags.DEFINE_float("hours", None, "Predict the tokens and cost of this many hours.")
_PRICE = flags.DEFINE_float("price-per-hour", None, "$/h for all the devices together "
                            "(default: the catalog's per-device price × devices).")
_POWER_PRICE = flags.DEFINE_float("power-price", 0.15, "$/kWh for the on-premise cost.")
_YEARS = flags.DEFINE_float("amortize-years", 5.0, "Years over which a purchase is spread.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")
_SEARCH = flags.DEFINE_bool("search", False, "Rank the layouts that fit.")
_BY = flags.DEFINE_enum("by", "time", ["time", "cost"], "--search ranking.")
_TOP = flags.DEFINE_integer("top", 5, "--search: how many plans to print.")
_COMPILE = flags.DEFINE_bool("compile", False, "AOT-compile the real step on fake CPU "
                             "devices and show XLA's per-device memory.")
_COMPARE = flags.DEFINE_string("compare", None, "Offers to compare, comma-separated "
                               "NAME[:DEVICES] (e.g. H100-SXM:256,GB200:256,v7:256): each "
                               "on its fastest layout that fits, ranked by cost and time.")
_PLOT = flags.DEFINE_string("plot", None, "--compare: write days against cost to FILE.png.")
flags.mark_flags_as_required(["config"])


def _plan(argv) -> None:
    del argv
    from jaxtrain import hardware as catalog
    from jaxtrain.config import ConfigError
    from jaxtrain.hardware import HardwareError
    from jaxtrain.plan.planner import format_plan, make_plan
    from jaxtrain.plan.search import override_flags, search

    cfg = _CONFIG.value
    if _TOKENS.value is not None and _HOURS.value is not None:
        exit_usage("--tokens and --hours are exclusive: give one")
    if _COMPARE.value is not None or _PLOT.value is not None:
        _compare(cfg)
        return
    if _HARDWARE.value is None:
        exit_usage("--hardware is missing: give a catalog entry (or --compare OFFERS)")
    try:
        hw = catalog.get(_HARDWARE.value, _HARDWARE_FILE.value)
        devices = _DEVICES.value or catalog.slice_devices(_HARDWARE.value)
        if not devices or devices < 1:
            exit_usage(f"--devices={_DEVICES.value} is invalid: give a positive device count")
        args = dict(tokens=_TOKENS.value, hours=_HOURS.value, price_per_hour=_PRICE.value,
                    power_price=_POWER_PRICE.value, amortize_years=_YEARS.value)
        if _SEARCH.value:
            confirm = _confirm(cfg, devices) if _COMPILE.value else None
            plans = search(cfg, hw, devices, by=_BY.value, top=_TOP.value, confirm=confirm,
                           **args)
        else:
            plans = [make_plan(cfg, hw, devices, **args)]
    except (ConfigError, HardwareError) as e:
        exit_usage(str(e))
    if _COMPILE.value:
        _add_compiled(plans, cfg, devices)
    if _JSON.value:
        print(json.dumps(plans if _SEARCH.value else plans[0], indent=1, default=str))
        return
    if _SEARCH.value and not plans:
        print(f"no layout of {cfg.name} fits {devices} × {hw.name}")
    for rank, plan in enumerate(plans, 1):
        if _SEARCH.value:
            print(f"#{rank}: {override_flags(plan['overrides'])}")
        print(format_plan(plan))
        print()


def _compare(cfg) -> None:
    from jaxtrain.plan import compare as compare_lib

    if _COMPARE.value is None:
        exit_usage("--plot is invalid without --compare: give the offers to plot")
    if _HARDWARE.value or _SEARCH.value or _COMPILE.value or _PRICE.value is not None:
        exit_usage("--compare is invalid with --hardware, --search, --compile or "
                   "--price-per-hour: each offer is priced from the catalog")
    if _PLOT.value and not _PLOT.value.endswith(".png"):
        exit_usage(f"--plot={_PLOT.value} is invalid: give a FILE.png")
    try:
        offers = compare_lib.parse_offers(_COMPARE.value, _DEVICES.value, _HARDWARE_FILE.value)
    except (compare_lib.CompareError, compare_lib.HardwareError) as e:
        exit_usage(str(e))
    rows = compare_lib.compare(cfg, offers, tokens=_TOKENS.value, hours=_HOURS.value,
                               power_price=_POWER_PRICE.value, amortize_years=_YEARS.value)
    if _PLOT.value:
        from jaxtrain.plan.compare_plot import plot

        plot(cfg.name, rows, _PLOT.value)
    if _JSON.value:
        print(json.dumps(rows, indent=1, default=str))
        return
    print(compare_lib.format_table(cfg.name, rows))
    if _PLOT.value:
        print(f"plot: {_PLOT.value}")


def _confirm(cfg, devices: int):
    """compile_check for a search candidate's overrides, in this process."""
    import jax

    from jaxtrain.config import validate
    from jaxtrain.plan import memory
    from jaxtrain.plan.compile_check import compiled_memory
    from jaxtrain.plan.search import with_overrides

    def confirm(overrides: dict) -> dict:
        target = with_overrides(cfg, overrides)
        compiled = compiled_memory(target, jax.devices()[:devices])
        compiled["estimate_cpu_bytes"] = memory.estimate(
            target, validate(target, devices), "cpu")["total"]
        return compiled

    return confirm


def _add_compiled(plans: list[dict], cfg, devices: int) -> None:
    import jax

    from jaxtrain.plan import memory
    from jaxtrain.plan.compile_check import compiled_memory
    from jaxtrain.plan.search import with_overrides

    if jax.device_count() < devices:
        exit_usage(f"--compile needs {devices} fake devices but jax has {jax.device_count()}: "
              "run as jaxtrain plan so they are set before jax loads")
    for plan in plans:
        if "compiled" in plan:
            continue  # --search already compiled it
        target = with_overrides(cfg, plan["overrides"]) if "overrides" in plan else cfg
        compiled = compiled_memory(target, jax.devices()[:devices])
        compiled["fits"] = compiled["total_bytes_per_device"] <= plan["memory"]["usable_bytes"]
        # The like-for-like estimate: XLA's CPU backend keeps bf16 activations in float32.
        compiled["estimate_cpu_bytes"] = memory.estimate(target, plan["mesh"], "cpu")["total"]
        plan["compiled"] = compiled


def _fake_devices_before_jax(argv: list[str]) -> None:
    """--compile needs N fake CPU devices, which XLA reads once, when jax is imported."""
    if "--compile" not in argv:
        return
    devices = None
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            devices = arg.split("=", 1)[1]
        elif arg == "--devices" and i + 1 < len(argv):
            devices = argv[i + 1]
        elif arg.startswith("--hardware") and devices is None:
            name = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            devices = slice_devices(name)
    if devices:
        os.environ["XLA_FLAGS"] = with_device_count(int(devices))
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> None:
    _fake_devices_before_jax(sys.argv[1:] if argv is None else argv)
    run_absl("plan", _plan, argv, paths=("hardware-file",), epilog=OVERRIDES_HELP)


if __name__ == "__main__":
    main()
