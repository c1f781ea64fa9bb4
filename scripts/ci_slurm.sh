#!/usr/bin/env bash
# CI: start a two-node SLURM here (network namespaces), run tests/test_slurm.py against it, stop what this started.
#
#   bash scripts/ci_slurm.sh [pytest args]      (as root on Debian; installs slurm-wlm + munge)
#
# Idempotent: a cluster already running from $LOCAL_SLURM_DIR is used and left running; one that
# this script starts is stopped on exit (trap; daemons are stopped by their pid files).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=scripts/slurm/local_cluster.sh
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/megatron-pp-slurm}
eval "$(bash "$CLUSTER" env)"  # SLURM_CONF for sbatch/sinfo in the tests
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }

[ -x .venv/bin/python ] || bash scripts/setup_env.sh

if bash "$CLUSTER" status >/dev/null 2>&1; then
  echo "ci_slurm: using the SLURM already running from $LOCAL_SLURM_DIR (left running)"
else
  trap 't=$(now); bash "$CLUSTER" stop || true; echo "ci_slurm: cluster stopped in $(took "$t")"' EXIT
  t=$(now)
  timeout 300 bash "$CLUSTER" start --nodes 2
  echo "ci_slurm: cluster up in $(took "$t")"
fi

t=$(now)
rc=0
timeout 900 .venv/bin/python -m pytest -q -rs tests/test_slurm.py "$@" || rc=$?
echo "ci_slurm: tests/test_slurm.py exit $rc in $(took "$t")"
exit "$rc"
