#!/usr/bin/env bash
# scripts/venv_install.sh VENV ARGS...: `pip install ARGS...` into VENV (which exists),
# done by uv (installed into VENV first) and compiled, or by pip when uv cannot do it.
# uv made the dev venv in 10 s of a clean machine where pip took 29 s, the first step of
# `make test` before any test starts, and the integrations' three venvs beside it in a
# third of the CPU. uv reads no pip.conf: where it cannot reach the index, pip runs.
set -uo pipefail
venv=$1; shift
py="$venv/bin/python"
if "$py" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 &&
   "$py" -m uv pip install --quiet --compile-bytecode --python "$py" "$@"; then
  exit 0
fi
echo "uv could not install into $venv; pip does" >&2
"$py" -m pip install --quiet --upgrade pip && "$py" -m pip install --quiet "$@"
