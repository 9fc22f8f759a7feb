#!/usr/bin/env sh
# One entry point for a fresh clone: creates .venv, installs the project with its embedded
# PostgreSQL and test tools, then runs what was asked.
#   sh scripts/dev.sh demo [OPTIONS]   agents writing to a throwaway local PostgreSQL
#   sh scripts/dev.sh test [PYTEST…]   the whole test suite (PostgreSQL 15 and 18 where present)
#   sh scripts/dev.sh lint             ruff check, ruff format --check, the layer contract, mypy
#   sh scripts/dev.sh bench NAME       a benchmark under bench/
# PYTHON picks the interpreter a new venv is made with, VENV where it lives (.venv): e.g.
#   PYTHON=python3.13 VENV=.venv-3.13 sh scripts/dev.sh test
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP=$VENV/.installed
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[embedded,dev]'
    touch "$STAMP"
fi
cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
    demo) exec "$VENV/bin/ledger-cdc" demo "$@" ;;
    test)
        # no arguments: the whole suite, spread over the machine's cores (one worker per core,
        # tests that share a module fixture kept on one worker)
        if [ $# -eq 0 ]; then set -- -n auto --dist loadgroup; fi
        exec "$VENV/bin/python" -m pytest "$@" ;;
    lint)
        "$VENV/bin/ruff" check ledger_cdc tests bench
        "$VENV/bin/ruff" format --check ledger_cdc tests bench
        "$VENV/bin/lint-imports" --no-cache
        exec "$VENV/bin/mypy" --strict ledger_cdc ;;
    bench) name=$1; shift; exec "$VENV/bin/python" "bench/$name.py" "$@" ;;
    *) sed -n '2,8p' "$0"; exit 2 ;;
esac
