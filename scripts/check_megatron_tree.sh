#!/usr/bin/env bash
# Run the release window's tests against a Megatron-LM checkout (a release branch or main):
#
#   bash scripts/check_megatron_tree.sh PATH [pytest args]
#
# 1. stages the checkout's `megatron/` package in a temporary folder, with the compiled dataset
#    helpers of the venv's wheel (a checkout has only their C++ source; Megatron would run
#    `make` at start-up), and puts it first on PYTHONPATH, the checkout's root next (its
#    pretrain_gpt.py, model_provider.py, gpt_builders.py): megatron.core and megatron.training
#    are then the checkout's, torch and the rest the venv's;
# 2. runs the tests conftest.RELEASE_WINDOW names (pytest -m release_window, as the release
#    matrix of scripts/test.sh runs them on the wheels) and tests_megatron_lm (the
#    checkout's own pretrain_gpt.py through scripts/pretrain_gpt_pp.py);
# 3. prints one line to record in docs/megatron-versions.md: the checkout's branch, commit and
#    date, megatron-core's version there, and the two pytest results.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=${1:?usage: scripts/check_megatron_tree.sh PATH-TO-MEGATRON-LM [pytest args]}
shift
tree=$(cd "$tree" && pwd)
[ -f "$tree/megatron/core/__init__.py" ] && [ -f "$tree/pretrain_gpt.py" ] || {
  echo "check_megatron_tree.sh: $tree is not the root of a Megatron-LM checkout" \
       "(no megatron/core/ or pretrain_gpt.py)" >&2; exit 2; }
bash scripts/setup_env.sh

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r "$tree/megatron" "$stage/megatron"
wheel_datasets=$(.venv/bin/python -c 'import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))')
for helper in "$wheel_datasets"/helpers_cpp*.so; do
  [ -e "$stage/megatron/core/datasets/$(basename "$helper")" ] || cp "$helper" "$stage/megatron/core/datasets/"
done
export PYTHONPATH="$stage:$tree${PYTHONPATH:+:$PYTHONPATH}"
# the tests' Megatron-LM loop runs this checkout's own pretrain_gpt.py (tests/support/
# megatron_lm_scripts.py), not the shared folder's copy of a release
export MEGATRON_LM_SCRIPT_DIR=$tree

git_dir=$tree
describe="$(git -C "$git_dir" rev-parse --abbrev-ref HEAD 2>/dev/null || echo '?') $(git -C "$git_dir" log -1 --format='%h %cs' 2>/dev/null || echo '')"
version=$(.venv/bin/python -c 'from megatron_pp_ext.megatron_compat import megatron_core_version as v; print(v())')
echo "check_megatron_tree.sh: $tree ($describe), megatron-core $version"

workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -le 4 ] || workers=4
rc=0
# tee to the open stderr (not /dev/stderr, which opens the file again: with `> log 2>&1` that
# truncates the log under the other writer)
window=$(.venv/bin/python -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder \
  -m release_window "$@" tests 2>&1 | tee >(cat >&2) | tail -n 1) || rc=1
# patches/pretrain_gpt_core_r0.19.0.patch is for that branch's pretrain_gpt.py alone: elsewhere
# only scripts/pretrain_gpt_pp.py (the "wrapper" cases) is checked
only=()
case "$version" in 0.19.*) ;; *) only=(-k wrapper) ;; esac
scripts=$(MEGATRON_LM_PATH="$tree" .venv/bin/python -m pytest -q "${only[@]}" "$@" tests_megatron_lm 2>&1 \
  | tee >(cat >&2) | tail -n 1) || rc=1
echo "check_megatron_tree.sh: $describe | megatron-core $version | window: $window | scripts: $scripts"
exit "$rc"
