"""Counts the tests and their checks under a folder, by reading the source: test functions,
assert statements, pytest.raises/fail/warns, and numpy/torch testing asserts (#51: a change
to the suite's shape must not lower them).

    python scripts/table_test_counts.py [FOLDER]      # default: tests
"""

import ast
import pathlib
import sys

RAISES = ("pytest.raises", "pytest.fail", "pytest.warns")
TESTING = ("np.testing.assert", "numpy.testing.assert", "torch.testing.assert")


def counts(root: pathlib.Path) -> dict:
    c = dict.fromkeys(["test functions", "assert statements", "pytest.raises/fail/warns",
                       "np/torch.testing asserts"], 0)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test_"):
                c["test functions"] += 1
            elif isinstance(node, ast.Assert):
                c["assert statements"] += 1
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                c["pytest.raises/fail/warns"] += name in RAISES
                c["np/torch.testing asserts"] += name.startswith(TESTING)
    return c


if __name__ == "__main__":
    found = counts(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tests"))
    checks = sum(v for k, v in found.items() if k != "test functions")
    print(", ".join(f"{k} {v}" for k, v in found.items()) + f", total checks {checks}")
