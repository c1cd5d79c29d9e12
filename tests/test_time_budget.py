"""The per-file time budget of `make test` (tests/time_budget.py): a file over its budget, or without one, fails the
run with its time and the budget; under xdist the workers' times reach the controller."""

import textwrap
import tomllib
from pathlib import Path

import pytest
from conftest import run_py

HERE = Path(__file__).resolve().parent


def test_every_test_file_has_a_budget_and_every_budget_a_file():
    budgets = tomllib.loads((HERE / "time_budgets.toml").read_text())["budgets"]
    files = {path.name for path in HERE.glob("test_*.py")}
    assert files - budgets.keys() == set(), "test files without a budget in tests/time_budgets.toml"
    assert budgets.keys() - files == set(), "budgets in tests/time_budgets.toml for files that do not exist"


def test_a_file_over_its_budget_or_without_one_fails_the_run(tmp_path):
    """Under xdist (the workers' reports counted on the controller) a file over its budget and one without a budget
    fail a run whose tests passed; in one process, within the budgets, the run passes and prints the table."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import time_budget

        def pytest_configure(config):
            time_budget.register(config)
    """))
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(0.8)\n")
    (tmp_path / "test_unbudgeted.py").write_text("def test_unbudgeted():\n    pass\n")
    budgets = tmp_path / "budgets.toml"
    # A reference the calibration never exceeds: the budgets are not stretched.
    budgets.write_text('[calibration]\nreference_seconds = 1000.0\n\n[budgets]\n"test_quick.py" = 60\n'
                       '"test_slow.py" = 0.5\n')
    env = {"MST_TIME_BUDGETS": str(budgets)}

    result = run_py(["-m", "pytest", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env_extra=env)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "3 passed" in result.stdout  # the tests themselves passed
    assert "time budget: test_slow.py took 0.8 s, over its budget of 0.5 s" in result.stdout, result.stdout[-3000:]
    assert "time budget: test_unbudgeted.py took 0.0 s and has no budget in budgets.toml" in result.stdout
    assert "test_quick.py took" not in result.stdout

    budgets.write_text(budgets.read_text().replace('"test_slow.py" = 0.5', '"test_slow.py" = 30'))
    result = run_py(["-m", "pytest", "-p", "no:cacheprovider", str(tmp_path / "test_quick.py"),
                     str(tmp_path / "test_slow.py")], cwd=tmp_path, env_extra=env)
    assert result.returncode == 0, result.stdout[-3000:]
    table = result.stdout.split("time per test file")[1]
    assert "test_slow.py" in table and "test_quick.py" in table and "all files" in table
    assert "time budget:" not in result.stdout


def test_a_slower_machine_stretches_the_budgets(tmp_path):
    """The calibration workload timed slower than the reference stretches every budget by that ratio."""
    import time_budget

    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[calibration]\nreference_seconds = 0.5\n\n[budgets]\n"test_a.py" = 10\n')
    budget = time_budget.TimeBudget(budgets)
    budget.calibrations = [0.4, 1.5]  # the slower of the two timings counts
    assert budget.scale() == pytest.approx(3.0)
    budget.calibrations = [0.2, 0.3]  # a faster machine never shrinks them
    assert budget.scale() == 1.0
