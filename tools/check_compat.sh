#!/usr/bin/env bash
# Run tests/unit/test_compat.py (anyshard's uses of private torch and s3fs APIs) under the oldest
# torch that pyproject.toml allows and under the newest on the package index, each in a fresh
# virtual environment. Not part of the test suite: it downloads two torch wheels.
#
#   tools/check_compat.sh [WORKDIR]        (default: a new temporary directory)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu tools/check_compat.sh   (CPU wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
oldest=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$oldest" ] || { echo "no torch>=X in pyproject.toml" >&2; exit 2; }
mapfile -t deps < <(sed -n '/^dependencies = \[/,/^\]/p' pyproject.toml | grep -o '"[^"]*"' \
    | tr -d '"' | grep -v '^torch\b')
[ "${#deps[@]}" -gt 0 ] || { echo "no dependencies = [...] in pyproject.toml" >&2; exit 2; }
index=()
[ -n "${TORCH_INDEX_URL:-}" ] && index=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
status=0
for which in oldest newest; do
    spec=torch
    [ "$which" = oldest ] && spec="torch==$oldest.*"
    env="$work/$which"
    python -m venv "$env"
    "$env/bin/pip" install -q "${index[@]}" "$spec"
    # anyshard's dependencies as pyproject.toml lists them (torch aside), and s3fs for its
    # checks; anyshard itself runs from the checkout (PYTHONPATH): nothing is written there
    "$env/bin/pip" install -q "${deps[@]}" s3fs pytest hypothesis
    version=$("$env/bin/python" -c 'import torch; print(torch.__version__)')
    echo "== torch $version ($which)"
    # one file in one process: not the suite's addopts (two xdist workers)
    PYTHONPATH=$PWD "$env/bin/python" -m pytest tests/unit/test_compat.py -q -p no:cacheprovider \
        -rs -o addopts= || status=1
done
exit $status
