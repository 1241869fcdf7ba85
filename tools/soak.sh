#!/usr/bin/env bash
# The soak runs: longer variants of suite tests (more layout pairs, more launchers, more
# scenarios), marked "slow" and left out of `python -m pytest` to keep the suite short. They
# draw nothing at random (faults at fixed steps, trainers seeded from their configs): no --seed.
#   tools/soak.sh                 # all of them
#   tools/soak.sh tests/dist -x   # more pytest words
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -m slow "$@"
