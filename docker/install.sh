#!/usr/bin/env bash
# Every package an image installs, in one place: docker/Dockerfile and docker/Dockerfile.cpu run this
# script, and tests/deploy/test_install.py runs it into a fresh venv (CI builds no image).
#
#   install.sh cpu WHEEL PYTHON [TORCH_INDEX]  the native engine: torch 2.13.0 (from TORCH_INDEX,
#                                              the CPU wheels, when given), the core lock, WHEEL
#   install.sh gpu WHEEL PYTHON                on vLLM's image: WHEEL and the core packages that
#                                              image lacks; nothing the image has changes version
set -euo pipefail
target=$1 wheel=$2 python=$3 torch_index=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
pip=("$python" -m pip install --no-cache-dir --disable-pip-version-check --quiet)

case $target in
cpu)
  # torch first, with its own dependencies; the lock then goes in as a full freeze (--no-deps).
  "${pip[@]}" ${torch_index:+--index-url "$torch_index"} torch==2.13.0
  "${pip[@]}" --no-deps -r "$here/../requirements-core.lock"
  "${pip[@]}" --no-deps "$wheel"
  ;;
gpu)
  # vLLM's image pins torch, transformers and the CUDA stack for vLLM: hold every installed
  # version as a constraint, so pip adds what loraplex needs beside them or fails the build.
  held=$(mktemp)
  "$python" -m pip freeze --all | grep -E '^[A-Za-z0-9._-]+==' >"$held"
  "${pip[@]}" --constraint "$held" "$wheel"
  rm -f "$held"
  ;;
*)
  echo "usage: install.sh cpu|gpu WHEEL PYTHON [TORCH_INDEX]" >&2
  exit 2
  ;;
esac
# The install is whole when the command and its engine import.
"$python" -c "import loraplex.cli, loraplex.engines.native"
