"""A time budget per test file: `make test` prints each file's worker-seconds beside its budget, and a file over its
budget fails the run, naming its time and the budget.

A file's time is the sum of its tests' setup, call and teardown durations, as pytest reports them (under xdist the
workers' reports reach the controller, which keeps the count). Budgets are seconds on this project's machine kind
(2 cores, 24 GiB, one intra-op thread per worker, quiet) in `time_budgets.toml` beside this file. The machines are
shared, so before the first test and after the last one a fixed workload is timed (the best of a few runs), and
the budgets stretch by how much slower than the reference machine that found this one (never shrink). A test file
without a budget fails the run too: a new file states what it may cost.
"""

import os
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

BUDGETS_PATH = Path(os.environ.get("MST_TIME_BUDGETS", Path(__file__).with_name("time_budgets.toml")))


def calibration_seconds(repeats=3):
    """The best of `repeats` timings of a fixed workload of plain Python (the suite is host-bound: tiny models, many
    small operators), on one core."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        values = [(i * 7919) % 10007 for i in range(400_000)]
        values.sort()
        sum(v * v for v in values)
        best = min(best, time.perf_counter() - start)
    return best


def shown(seconds):
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


class TimeBudget:
    def __init__(self, path):
        table = tomllib.loads(path.read_text())
        self.path = path
        self.reference_seconds = float(table["calibration"]["reference_seconds"])
        self.budgets = {name: float(seconds) for name, seconds in table["budgets"].items()}
        self.seconds = defaultdict(float)
        self.tests = defaultdict(set)
        self.calibrations = []
        self.over = []

    def scale(self):
        return max(1.0, max(self.calibrations, default=self.reference_seconds) / self.reference_seconds)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        self.calibrations.append(calibration_seconds())

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.seconds[path] += report.duration
        self.tests[path].add(report.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        self.calibrations.append(calibration_seconds())
        scale = self.scale()
        for path, seconds in self.seconds.items():
            budget = self.budgets.get(Path(path).name)
            if budget is None:
                self.over.append(f"{path} took {shown(seconds)} s and has no budget in {self.path.name}")
            elif seconds > budget * scale:
                self.over.append(f"{path} took {shown(seconds)} s, over its budget of {shown(budget)} s"
                                 + (f" (x{scale:.2f} for this machine's speed: {shown(budget * scale)} s)"
                                    if scale > 1 else ""))
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        write = terminalreporter.write_line
        terminalreporter.section("time per test file (worker-seconds)")
        scale = self.scale()
        write(f"calibration {', '.join(f'{c:.3f}' for c in self.calibrations)} s against the reference "
              f"{self.reference_seconds:.3f} s: budgets x{scale:.2f}")
        write(f"{'file':<44} {'tests':>6} {'seconds':>8} {'budget':>7}")
        for path, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            budget = self.budgets.get(Path(path).name)
            allowed = "none" if budget is None else shown(budget * scale)
            write(f"{path:<44} {len(self.tests[path]):>6} {seconds:>8.1f} {allowed:>7}")
        write(f"{'all files':<44} {sum(len(t) for t in self.tests.values()):>6} "
              f"{sum(self.seconds.values()):>8.1f}")
        for line in self.over:
            write("time budget: " + line, red=True, bold=True)


def register(config):
    """Called from conftest's pytest_configure: on the controller (or a plain run), never on an xdist worker."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(TimeBudget(BUDGETS_PATH), "mst_time_budget")
