#!/usr/bin/env bash
# The whole test suite: lint, then every test (distributed ones start real gloo ranks).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check .
python -m pytest -q "$@"
