#!/usr/bin/env bash
# scripts/venv_install.sh VENV ARGS...: `pip install ARGS...` into VENV (which exists),
# done by uv (installed into VENV first) and compiled, or by pip when uv cannot do it.
# uv made the dev venv in 12 s of a clean machine where pip took 29 s, the first step of
# `make test` before any test starts, and the integrations' three venvs beside it in
# two thirds of the CPU. uv reads no pip.conf and no PIP_* variables: pip's index URLs,
# find-links folders, constraint file and certificate are handed to it here, so both
# install from the same places under the same caps, the best version of every index
# taken (as pip does; uv by default takes the first index that has the package).
set -uo pipefail
venv=$1; shift
py="$venv/bin/python"

pip_setting() {  # pip_setting KEY ENV: the value of pip's KEY (pip config, or $ENV)
  local value
  value=$("$py" -m pip config get "global.$1" 2>/dev/null) || value=""
  printf '%s %s' "$value" "${!2:-}"
}

uv_args=()
for url in $(pip_setting index-url PIP_INDEX_URL); do uv_args+=(--index-url "$url"); done
for url in $(pip_setting extra-index-url PIP_EXTRA_INDEX_URL); do
  # a file:// index that is not there is skipped (pip warns and goes on; uv would stop)
  if [[ $url != file://* || -d ${url#file://} ]]; then uv_args+=(--extra-index-url "$url"); fi
done
for links in $(pip_setting find-links PIP_FIND_LINKS); do
  if [[ $links != /* || -d $links ]]; then uv_args+=(--find-links "$links"); fi
done
for constraint in $(pip_setting constraint PIP_CONSTRAINT); do
  if [[ -f $constraint ]]; then uv_args+=(--constraint "$constraint"); fi
done
cert=$(pip_setting cert PIP_CERT | awk '{print $1}')
if [[ -n $cert && -f $cert ]]; then export SSL_CERT_FILE=${SSL_CERT_FILE:-$cert}; fi

if "$py" -m pip install --quiet uv >/dev/null 2>&1 &&
   "$py" -m uv pip install --quiet --compile-bytecode --index-strategy unsafe-best-match --python "$py" ${uv_args[@]+"${uv_args[@]}"} "$@"; then
  exit 0
fi
echo "uv could not install into $venv; pip does" >&2
"$py" -m pip install --quiet --upgrade pip && "$py" -m pip install --quiet "$@"
