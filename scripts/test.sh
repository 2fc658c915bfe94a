#!/usr/bin/env bash
# The whole test suite: lint, then every test (distributed ones start real gloo ranks).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check .
# Two to four pytest workers (pytest-xdist), one test file per worker at a time (--dist loadfile keeps a
# file's module fixtures in one process). On 2 cores with two workers the suite took 14 to 16 minutes
# (856 s for 1031 tests; 16 min for 1044 passed and 16 skipped in issue 27's run); its slowest tests
# alone take over 25 minutes of CPU, so one worker would be far slower. The suite grows: count with
# `pytest --collect-only -q | tail -1` rather than trusting a figure here. A fresh clone without the megatron
# venv, on the 2 cores shared with other suites (load 10 to 18): 4453 tests in 5373 s, test durations summing
# to 10619 s, so both workers were busy to the end (xdist's file order leaves no idle tail to win back).
# Unshared, the same command took 1380 s (CI: 1688 s of tests); with the launcher forking its ranks itself
# (docs/performance.md, "Launcher start-up") 1108 s.
WORKERS=${PYTEST_WORKERS:-$(python -c "import os; print(max(2, min(4, os.cpu_count() or 2)))")}
python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
