"""The test tiers (tests/README.md): every test file sits in a tier folder, each tier's budget
is the one both READMEs state, and CI's check (tests/budgets.py) fails a tier more than 25%
over its budget, naming its slowest tests, and passes one within it."""

import pathlib
import re

import budgets
import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _junit(path, cases):
    """A pytest-style junit XML file of (classname, name, seconds)."""
    rows = "".join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}'
                    "</testsuite></testsuites>")
    return str(path)


def test_every_test_file_is_in_a_tier_folder_with_a_budget():
    flat = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not flat, f"test files outside every tier folder: {flat}"
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders == set(budgets.BUDGETS_MIN), (folders, set(budgets.BUDGETS_MIN))


@pytest.mark.parametrize("readme", ["tests/README.md", "README.md"])
def test_both_readmes_state_the_budgets_the_check_holds(readme):
    text = (TESTS.parent / readme).read_text()
    stated = {tier: float(minutes) for tier, minutes in
              re.findall(r"\|\s*`?tests/(\w+)`?\s*\|[^|\n]*\|\s*([\d.]+) min\s*\|", text)}
    assert stated == budgets.BUDGETS_MIN, f"{readme} states {stated}"


def _rows_and_listed(report):
    """{tier: its row} and {tier: the test lines listed under it} of a budgets report."""
    rows, listed, tier = {}, {}, None
    for line in report.splitlines()[1:]:
        if line.startswith(" "):
            listed[tier].append(line.strip())
        else:
            tier = line.split()[0]
            rows[tier], listed[tier] = line, []
    return rows, listed


def test_a_tier_over_its_budget_fails_naming_its_slowest_tests(tmp_path):
    limit_s = budgets.BUDGETS_MIN["parity"] * 60 * budgets.WORKERS * budgets.SLACK
    within = _junit(tmp_path / "ok.xml", [("tests.parity.test_lora", "test_a", limit_s - 2),
                                          ("tests.unit.test_layers", "test_b", 1.0)])
    ok, report = budgets.check(budgets.read_times(within))
    assert ok and "OVER" not in report, report

    over = _junit(tmp_path / "over.xml", [("tests.parity.test_lora", "test_a", limit_s - 2),
                                          ("tests.parity.test_dpo", "test_slowed", 5.0),
                                          ("tests.unit.test_layers", "test_b", 1.0)])
    ok, report = budgets.check(budgets.read_times(over))
    rows, listed = _rows_and_listed(report)
    assert not ok
    assert "OVER BUDGET" in rows["parity"], report
    assert [line.split()[-1] for line in listed["parity"]] == [
        "tests.parity.test_lora::test_a", "tests.parity.test_dpo::test_slowed"], report
    assert listed["unit"] == [], "a tier within budget lists no tests"
    assert budgets.main([over]) == 1 and budgets.main([within]) == 0


def test_a_test_outside_every_tier_fails_and_a_bad_file_is_exit_2(tmp_path, capsys):
    stray = _junit(tmp_path / "stray.xml", [("tests.test_flat", "test_x", 0.1)])
    ok, report = budgets.check(budgets.read_times(stray))
    assert not ok and "NOT IN A TIER" in report and "tests.test_flat::test_x" in report
    (tmp_path / "broken.xml").write_text("<testsuites>")
    assert budgets.main([str(tmp_path / "broken.xml")]) == 2
    assert budgets.main([str(tmp_path / "missing.xml")]) == 2
    assert "cannot read" in capsys.readouterr().err
