#!/usr/bin/env python3
"""Counts what the test suite ran and skipped, from its logs.

    scripts/test_summary.py CARGO_LOG PYTEST_LOG SKIPS_FILE TIMES_FILE

CARGO_LOG: `cargo test` output (its `test result:` lines). PYTEST_LOG:
pytest's output with `-rs` (its `SKIPPED` lines and final counts).
SKIPS_FILE: one line per part of a Rust test that could not run here
(tests/common `skip`). TIMES_FILE: `STEP SECONDS` lines. Exits non-zero
if a count cannot be read: a summary that says nothing is a failure.
"""

import re
import sys


def cargo_counts(text):
    totals = {"passed": 0, "failed": 0, "ignored": 0}
    found = False
    for m in re.finditer(
        r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", text
    ):
        found = True
        for key, n in zip(("passed", "failed", "ignored"), m.groups()):
            totals[key] += int(n)
    return totals if found else None


def pytest_counts(text):
    lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed)", l)]
    if not lines:
        return None, []
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (\w+)", lines[-1]))
    reasons = [l.strip() for l in text.splitlines() if l.startswith("SKIPPED")]
    return counts, reasons


def main():
    cargo_log, pytest_log, skips_file, times_file = sys.argv[1:5]
    read = lambda p: open(p, encoding="utf-8", errors="replace").read()
    cargo = cargo_counts(read(cargo_log))
    py, py_reasons = pytest_counts(read(pytest_log))
    try:
        skips = [l.strip() for l in read(skips_file).splitlines() if l.strip()]
    except FileNotFoundError:
        skips = []
    if cargo is None or py is None:
        print("test summary: no counts found in the logs", file=sys.stderr)
        return 1
    print("== summary")
    print(
        f"rust: {cargo['passed'] + cargo['failed']} tests run, "
        f"{cargo['failed']} failed, {cargo['ignored']} ignored; "
        f"{len(skips)} skipped in part"
    )
    for s in skips:
        print(f"  skipped: {s}")
    print(
        f"python: {py.get('passed', 0) + py.get('failed', 0)} tests run, "
        f"{py.get('failed', 0)} failed, {py.get('skipped', 0)} skipped"
    )
    for r in py_reasons:
        print(f"  {r}")
    times = [l.split() for l in read(times_file).splitlines() if l.strip()]
    print("time: " + ", ".join(f"{step} {int(float(s))} s" for step, s in times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
