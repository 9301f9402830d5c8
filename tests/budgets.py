"""The test tiers' time budgets, and the CI check that holds the suite to them.

    python tests/budgets.py JUNIT_XML      # exit 1 when a tier is over budget by > 25%

One pytest run of the whole suite (README's command, with --junitxml) gives every test's time
(setup, call and teardown). A tier's time is the sum over its tests divided by the two
workers: its share of the run's wall clock on the 2-core machine, without the per-tier
worker start-up and the idle tail that separate runs per tier would add. A tier more than
25% over its budget fails the check, listing its slowest tests. This is CI's check, never a
timed assert in a test: a loaded machine slows the run, it does not fail a test.

The budgets are in minutes on the 2-core CI machine; tests/README.md and README state them
(tests/unit/test_budgets.py keeps the three in step).
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET

WORKERS = 2
SLACK = 1.25  # a tier fails past budget x SLACK
BUDGETS_MIN = {  # tier folder under tests/ -> budget in minutes (tests/README.md says why)
    "unit": 6.0,
    "parallel": 2.5,
    "parity": 7.0,
    "storage": 3.5,
    "e2e": 6.0,
}
TOTAL_BUDGET_MIN = sum(BUDGETS_MIN.values())


def tier_of(classname: str) -> str | None:
    """'tests.unit.test_layers' (junit's classname, from the node id) -> 'unit'."""
    parts = classname.split(".")
    if "tests" in parts:
        i = parts.index("tests")
        if i + 1 < len(parts) and parts[i + 1] in BUDGETS_MIN:
            return parts[i + 1]
    return None


def read_times(junit_path: str) -> dict[str, list[tuple[float, str]]]:
    """tier -> [(seconds, test id)] from a pytest junit XML file. A test outside every tier
    is put under '(no tier)' so that it is counted, and named."""
    times: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        tier = tier_of(classname) or "(no tier)"
        times[tier].append((float(case.get("time", 0.0)), f"{classname}::{case.get('name')}"))
    return times


def check(times: dict[str, list[tuple[float, str]]], slowest: int = 8) -> tuple[bool, str]:
    """(within budget, the report). Each tier's minutes against its budget; a tier past
    budget x SLACK, or a test outside every tier, fails, with its slowest tests listed."""
    ok, lines = True, [f"{'tier':<10}{'tests':>6}{'minutes':>9}{'budget':>8}  (worker time / {WORKERS})"]
    for tier in [*BUDGETS_MIN, *sorted(set(times) - set(BUDGETS_MIN))]:
        cases = times.get(tier, [])
        minutes = sum(t for t, _ in cases) / WORKERS / 60
        budget = BUDGETS_MIN.get(tier)
        if budget is None:
            over, mark = True, "  NOT IN A TIER (move these tests into a tier folder)"
        else:
            over = minutes > budget * SLACK
            mark = "  OVER BUDGET by more than 25%" if over else ""
        lines.append(f"{tier:<10}{len(cases):>6}{minutes:>9.2f}{budget or 0:>8.1f}{mark}")
        if over:
            ok = False
            for seconds, name in sorted(cases, reverse=True)[:slowest]:
                lines.append(f"    {seconds:8.1f} s  {name}")
    total = sum(t for cases in times.values() for t, _ in cases) / WORKERS / 60
    lines.append(f"{'total':<10}{sum(map(len, times.values())):>6}{total:>9.2f}"
                 f"{TOTAL_BUDGET_MIN:>8.1f}")
    return ok, "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/budgets.py JUNIT_XML", file=sys.stderr)
        return 2
    try:
        times = read_times(argv[0])
    except (OSError, ET.ParseError) as e:
        print(f"tests/budgets.py: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 2
    ok, report = check(times)
    print(report)
    if not ok:
        print(f"CI: a test tier is more than {SLACK - 1:.0%} over its time budget (above, with "
              "its slowest tests); make it cheaper or move it (tests/README.md)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
