#!/usr/bin/env bash
# The project's test command (the README's second line):
#
#   bash scripts/test.sh [pytest args]      (default: -q tests)
#
# 1. sets up .venv/ (scripts/setup_env.sh: reused when requirements.txt and setup.py are unchanged);
#    and installs Debian's chromium if /usr/bin/chromium is missing (as root), for the HTML check
#    in a headless browser (tests/test_html_browser.py);
# 2. starts a two-node SLURM on this machine (scripts/slurm/local_cluster.sh start --nodes 2:
#    each node a network namespace with its own address; as root on Debian, installs
#    slurm-wlm + munge if missing) for tests/test_slurm.py, and stops it on exit (namespaces
#    and links removed); a SLURM already running from $LOCAL_SLURM_DIR is used and left running;
# 3. runs .venv/bin/python -m pytest -q -n W --dist loadscope --no-loadscope-reorder
#    --durations=15 tests (W pytest-xdist workers: the CPU count, at most 4, or
#    $MEGATRON_PP_TEST_WORKERS; each worker takes a
#    whole module at a time in collection order, which conftest.py makes longest module first,
#    so a module's shared results are built once; the 15 slowest tests listed), and exits
#    with pytest's status.
# 4. beside step 3, the release matrix: the tests conftest.RELEASE_WINDOW names, on each other
#    release of the supported window (support.megatron_releases.WINDOW: megatron-core 0.17.x,
#    0.18.x), each wheel installed once into .venv/megatron-releases/ and put first on
#    PYTHONPATH; the releases run side by side (one pytest process each), started with the
#    main run (its SLURM tests mostly wait, its last minute leaves a core idle: the matrix
#    fills that time); their output is printed after the main run's; the exit status is
#    non-zero when any run failed.
#    Most tests are one process on one core (the executor's threads share the GIL), so two
#    workers keep both cores busy; the multi-process ones (gloo ranks, the CLI's) take both
#    cores anyway.
# Steps 1 and 2 overlap: chromium and then the cluster (apt-get, one at a time) come in the
# background while setup_env.sh builds .venv/ (pip), and the release matrix's wheels are
# installed while step 3 starts: on a fresh clone or machine no download waits for another.
# If SLURM cannot be started the tests still run; the SLURM tests then fail and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=scripts/slurm/local_cluster.sh
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/megatron-pp-slurm}

# tests/test_html_browser.py checks the HTML timelines in a headless browser: Debian's chromium,
# installed here when it is missing (as root, with apt-get; $CHROMIUM names another binary).
install_chromium() {
  [ -z "${CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing chromium (apt-get) for the headless-browser test"
    local log
    log=$(mktemp)
    if ! { timeout 900 apt-get update -q && DEBIAN_FRONTEND=noninteractive \
           timeout 900 apt-get install -y -q chromium; } >"$log" 2>&1; then
      tail -n 20 "$log" >&2
      echo "test.sh: could not install chromium (see above): the browser test will fail" >&2
    fi
    rm -f "$log"
  else
    echo "test.sh: no /usr/bin/chromium and not root: the browser test will fail" \
         "(install it with: apt-get install -y chromium)" >&2
  fi
}

start_cluster() {  # its own apt-get install of slurm-wlm and munge when missing
  timeout 300 bash "$CLUSTER" start --nodes 2 \
    || echo "test.sh: could not start a local SLURM (see above): the SLURM tests will fail" >&2
}

own_cluster=1
if bash "$CLUSTER" status >/dev/null 2>&1; then
  own_cluster=0
  echo "test.sh: using the SLURM already running from $LOCAL_SLURM_DIR (left running)"
fi
# chromium, then the cluster (one apt-get at a time), beside setup_env.sh; printed once done
system_log=$(mktemp)
( install_chromium; [ "$own_cluster" = 0 ] || start_cluster ) >"$system_log" 2>&1 &
system_pid=$!
matrix_pid=
finish() {
  wait $system_pid $matrix_pid 2>/dev/null || true  # nothing of theirs left behind
  [ "$own_cluster" = 0 ] || bash "$CLUSTER" stop || true
  rm -f "$system_log"
}
trap finish EXIT

setup_rc=0
bash scripts/setup_env.sh || setup_rc=$?
wait "$system_pid" || true
cat "$system_log"
[ "$setup_rc" = 0 ] || exit "$setup_rc"
eval "$(bash "$CLUSTER" env)"  # SLURM_CONF for sbatch/sinfo in the tests

workers=${MEGATRON_PP_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
[ "$workers" -le 4 ] || workers=4
matrix=${MEGATRON_PP_RELEASE_MATRIX:-0}
[ $# -gt 0 ] || { matrix=1; set -- -q -n "$workers" --dist loadscope --no-loadscope-reorder --durations=15 \
  tests; }
if [ "$matrix" = 1 ]; then
  releases=$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests")
from support.megatron_releases import WINDOW; print(*WINDOW)')
fi
# The release matrix: the window's tests (conftest.RELEASE_WINDOW) on each other release of
# the supported window, its wheel installed once into .venv/megatron-releases/ and put first
# on PYTHONPATH (no second torch). Only with the default arguments (or
# MEGATRON_PP_RELEASE_MATRIX=1). The releases run side by side, one pytest worker each, and
# beside the main run: its SLURM tests mostly wait on SLURM, and its last minute leaves a core
# idle; the matrix fills those. Each release's output is printed whole once everything ends.
logs=$(mktemp -d)
run_release_matrix() {  # the window's wheels (once), then the releases side by side
  # (the loop below installs any that failed here, and says why)
  .venv/bin/python tests/support/megatron_releases.py $releases >/dev/null 2>&1 || true
  # only the modules that hold the window's tests: each process collects those (not all
  # 60 modules, 12 s of CPU)
  window_files=$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests")
from conftest import RELEASE_WINDOW
print(*sorted({"tests/" + selector.split("::")[0] + ".py" for selector, _ in RELEASE_WINDOW}))')
  for release in $releases; do
    overlay=$(.venv/bin/python tests/support/megatron_releases.py "$release")
    ( PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -q \
        -p no:cacheprovider --durations=5 -m release_window $window_files \
        >"$logs/$release.log" 2>&1; echo $? >"$logs/$release.rc" ) &
  done
  wait
}
if [ "$matrix" = 1 ]; then
  run_release_matrix &
  matrix_pid=$!
fi
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
echo "test.sh: pytest exit $rc"
if [ "$matrix" = 1 ]; then
  wait "$matrix_pid" || true
  for release in $releases; do
    echo "test.sh: megatron-core $release (the release matrix: pytest -m release_window)"
    cat "$logs/$release.log"
    release_rc=$(cat "$logs/$release.rc" 2>/dev/null || echo 1)
    echo "test.sh: megatron-core $release: pytest exit $release_rc"
    [ "$release_rc" = 0 ] || rc=$release_rc
  done
fi
rm -rf "$logs"
exit "$rc"
