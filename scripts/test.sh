#!/usr/bin/env bash
# The project's test command (the README's second line):
#
#   bash scripts/test.sh [pytest args]      (default: -q tests)
#
# 1. sets up .venv/ (scripts/setup_env.sh: reused when requirements.txt and setup.py are unchanged);
# 2. starts a one-node SLURM on this machine (scripts/slurm/local_cluster.sh start: as root on
#    Debian, installs slurm-wlm + munge if missing) for tests/test_slurm.py, and stops it on exit;
#    a SLURM already running from $LOCAL_SLURM_DIR is used and left running;
# 3. runs .venv/bin/python -m pytest -q tests, and exits with pytest's status.
# If SLURM cannot be started the tests still run; the SLURM tests then fail and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_env.sh

CLUSTER=scripts/slurm/local_cluster.sh
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/megatron-pp-slurm}
if bash "$CLUSTER" status >/dev/null 2>&1; then
  echo "test.sh: using the SLURM already running from $LOCAL_SLURM_DIR (left running)"
else
  trap 'bash "$CLUSTER" stop || true' EXIT
  timeout 300 bash "$CLUSTER" start \
    || echo "test.sh: could not start a local SLURM (see above): the SLURM tests will fail" >&2
fi
eval "$(bash "$CLUSTER" env)"  # SLURM_CONF for sbatch/sinfo in the tests

[ $# -gt 0 ] || set -- -q tests
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
echo "test.sh: pytest exit $rc"
exit "$rc"
