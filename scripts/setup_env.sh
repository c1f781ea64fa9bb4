#!/usr/bin/env bash
# Make (or reuse) the project's Python environment in .venv/ with python3.12 and the pinned
# packages of requirements.txt, then install this package in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in "${PYTHON:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
      /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  # pyenv's shim answers only when its version is selected.
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep '^3\.12' | tail -n 1)
    [ -n "$v" ] && { echo "$(pyenv root)/versions/$v/bin/python3.12"; return 0; }
  fi
  echo "no python3.12 found: install Python 3.12 or set PYTHON=/path/to/python3.12" >&2
  return 1
}

stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt setup.py | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0  # reuse the environment as it is
fi
if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
# --no-compile, then compileall on every core: pip byte-compiles one file at a time (half of
# the install's 80 s). The byte-compiling cannot be left to the first import: where
# PYTHONDONTWRITEBYTECODE is set (this machine, CI) no .pyc would ever be written, every
# process would compile what it imports again, and Python's compile-time SyntaxWarnings from
# Megatron's sources (kv_block_allocator.py's '\-') would land in every run's output.
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -r requirements.txt 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -W ignore -m compileall -q -j 0 \
  "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 \
  || true  # a file that does not compile fails only its own import, as with pip
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import torch, megatron.core, megatron_pp_ext" 2>/dev/null \
  || { echo "the environment in .venv/ does not import torch, megatron.core and megatron_pp_ext" >&2; exit 1; }
echo "$want" > "$stamp"
