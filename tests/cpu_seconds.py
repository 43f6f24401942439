"""Where a run's CPU time went, per test: the CPU seconds of the process that ran it and of every
child it waited for (subprocess pipelines, launches, servers), setup and teardown included. The
suite is CPU-bound on CI's 2 cores, so these, not the wall-clock `--durations` (which count a
test's waits and the other worker's load), say what a test costs the budget. Each report carries
its phase's seconds (`user_properties`, which xdist carries from its workers); the run ends with
the costliest tests and the total."""

import resource

import pytest

TOP = 30
_MARK = pytest.StashKey[float]()


def cpu_now() -> float:
    """User + system seconds of this process (all its threads) and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item):
    item.stash[_MARK] = cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Called once the phase is over; the report copies the item's list as it is made, so the
    # teardown report holds all three phases.
    now = cpu_now()
    item.user_properties.append((f"cpu_s_{call.when}", now - item.stash.get(_MARK, now)))
    item.stash[_MARK] = now
    yield


def pytest_terminal_summary(terminalreporter):
    seconds = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", "") == "teardown":  # holds the setup's and call's seconds too
                seconds[report.nodeid] = sum(v for k, v in report.user_properties if k.startswith("cpu_s_"))
    if not seconds:
        return
    terminalreporter.write_sep("=", f"{TOP} costliest tests in CPU seconds (the test's process and its children)")
    for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:TOP]:
        terminalreporter.write_line(f"{s:8.1f}s  {nodeid}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}s  in all, {len(seconds)} tests")
