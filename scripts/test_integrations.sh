#!/usr/bin/env bash
# The framework integrations' tests (docs/integrations.md), run by `make test` after the
# main suite, and by hand: scripts/test_integrations.sh [django52] [django6] [web]
# [newer-python]
# (scripts/test_integrations.sh --prepare only installs the venvs and fetches what the
# runs need: `make test` does that while the main suite runs)
#
#   django52  .venv-django52: Python 3.11, Django 5.2 + the django-tasks backport
#   django6   .venv-django6:  Python 3.12, Django 6.1.3 (django.tasks; pinned for the next)
#             each: errands (-e .[postgres]) + examples/django_shop's requirements; runs the
#             Django backend suite (integration/django) on SQLite and on PostgreSQL, then
#             examples/django_shop's tests; django6 also runs Django's own tests/tasks
#             (from the pinned release's sdist) against ErrandsBackend on both databases
#             (integration/django/upstream.py: ~5 s each, plus a one-time 11 MB download)
#   web       the FastAPI and Flask examples' tests, in the main .venv (the dev extra
#             has fastapi, flask, httpx and sqlalchemy)
#   newer-python  .venv-newer-python: Python 3.13 (3.12 if there is none), errands
#             (-e .[postgres]) + pytest; a short subset of errands' own tests where newer
#             Pythons behave differently (NEWER_PYTHON_TESTS: interrupts held back in
#             locking code, interrupts under a trace function, the handler runners, the
#             cycles a finished job must not leave and the collector's thresholds (3.13
#             changed its defaults), the SQLite connections' lifecycle, which 3.13 warns
#             of when one is left to the garbage collector): the main suite runs on 3.11
#             only. ~20 s.
#
# A venv is created once and reused; it is reinstalled when pyproject.toml or one of its
# requirements files changes (a stamp file holds their hash). Python 3.12 is found as
# $ERRANDS_PY312, python3.12 on PATH, or pyenv's newest 3.12.x (3.13 and 3.11 alike, with
# $ERRANDS_PY313 and $ERRANDS_PY311). PostgreSQL: 127.0.0.1:5432,
# user postgres (ERRANDS_TEST_PG_HOST/_PORT/_USER); unreachable, its suites are skipped,
# except with CI=true, where that fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG_DIR=$(mktemp -d)
trap 'rm -rf "$LOG_DIR"' EXIT
STEP_TIMEOUT=${ERRANDS_INTEGRATION_TIMEOUT:-420}
PASSED=0
FAILED=0
FAILED_STEPS=()
started=$(date +%s)

NEWER_PYTHON_TESTS=(
  tests/guarantees/test_interrupt_shield.py
  tests/guarantees/test_traced_process.py
  tests/unit/test_runners.py
  tests/unit/test_job_garbage.py
  tests/unit/test_worker_gc.py
  tests/integration/test_sqlite_connections.py
)

say() { printf '\n== %s\n' "$*"; }

find_python() {  # find_python 3.12 [ENV_OVERRIDE]
  local want=$1 override=${2:-} candidate
  if [[ -n $override ]]; then echo "$override"; return 0; fi
  for candidate in "python$want" \
      $(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$want".*/bin/python3 \
        2>/dev/null | sort -V -r) python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       [[ $("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) == "$want" ]]; then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}

ensure_venv() {  # ensure_venv DIR PYTHON REQUIREMENTS...
  local dir=$1 python=$2; shift 2
  local stamp="$dir/.errands-stamp" hash
  hash=$(cat pyproject.toml "$@" | sha256sum | cut -d' ' -f1)-$("$python" -V 2>&1 | tr ' ' '-')
  if [[ -x $dir/bin/python && -f $stamp && $(cat "$stamp") == "$hash" ]]; then
    return 0
  fi
  say "installing $dir ($("$python" -V 2>&1))"
  if [[ ! -x $dir/bin/python ]] || ! "$dir/bin/python" -V >/dev/null 2>&1; then
    rm -rf "$dir"
    "$python" -m venv "$dir" || return 1
  fi
  local args=()
  for requirements in "$@"; do args+=(-r "$requirements"); done
  bash scripts/venv_install.sh "$dir" -e '.[postgres]' "${args[@]}" || return 1
  echo "$hash" > "$stamp"
}

count() {  # count LOG: add the tests a Django or pytest run reported to the totals
  local log=$1 ran failures errors n
  if ran=$(grep -aoE '^Ran [0-9]+ tests?' "$log" | tail -1 | grep -oE '[0-9]+'); then
    # "(failures=2, errors=1, expected failures=30)": expected failures are not failures
    failures=$(grep -aoE '(\(|, )failures=[0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)
    errors=$(grep -aoE 'errors=[0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)
    n=$(( ${failures:-0} + ${errors:-0} ))
    PASSED=$(( PASSED + ran - n )); FAILED=$(( FAILED + n ))
    return 0
  fi
  local summary
  summary=$(grep -aE '[0-9]+ (passed|failed)' "$log" | tail -1)
  n=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || true)
  PASSED=$(( PASSED + ${n:-0} ))
  n=$(grep -oE '[0-9]+ failed' <<<"$summary" | grep -oE '[0-9]+' || true)
  FAILED=$(( FAILED + ${n:-0} ))
  n=$(grep -oE '[0-9]+ errors?' <<<"$summary" | grep -oE '[0-9]+' || true)
  FAILED=$(( FAILED + ${n:-0} ))
}

step() {  # step NAME DIR COMMAND...: run a test command (bounded in time), record the result
  local name=$1 dir=$2; shift 2
  local log="$LOG_DIR/$(tr -c 'a-zA-Z0-9' _ <<<"$name").log" t0=$SECONDS status
  say "$name"
  (cd "$dir" && timeout --kill-after=10 "$STEP_TIMEOUT" "$@") 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  count "$log"
  if (( status != 0 )); then
    (( status == 124 )) && echo "timed out after ${STEP_TIMEOUT}s"
    FAILED_STEPS+=("$name (exit $status)")
    if ! grep -aqE '^Ran [0-9]+ tests?|[0-9]+ (passed|failed)' "$log"; then
      FAILED=$(( FAILED + 1 ))  # it died before reporting: count the step as one failure
    fi
  fi
  echo "-- $name: $(( SECONDS - t0 ))s"
}

PG_READY=
pg_ready() {  # pg_ready PYTHON: can that python reach the test server?
  if [[ -z $PG_READY ]]; then
    if "$1" - <<'PY' 2>"$LOG_DIR/pg.err"; then PG_READY=yes; else PG_READY=no; fi
import os, psycopg
psycopg.connect(host=os.environ.get("ERRANDS_TEST_PG_HOST", "127.0.0.1"),
                port=os.environ.get("ERRANDS_TEST_PG_PORT", "5432"),
                user=os.environ.get("ERRANDS_TEST_PG_USER", "postgres"),
                dbname="postgres", connect_timeout=3).close()
PY
  fi
  [[ $PG_READY == yes ]]
}

newer_python() {  # newer_python: Python 3.13, else 3.12 (none: nothing, status 1)
  find_python 3.13 "${ERRANDS_PY313:-}" || find_python 3.12 "${ERRANDS_PY312:-}"
}

django_stack() {  # django_stack LABEL VENV PYTHON REQUIREMENTS [upstream]
  local label=$1 venv=$2 python=$3 requirements=$4 upstream=${5:-}
  if ! ensure_venv "$venv" "$python" "$requirements" examples/django_shop/requirements.txt; then
    FAILED_STEPS+=("$label: installing $venv"); FAILED=$(( FAILED + 1 )); return
  fi
  local py="$ROOT/$venv/bin/python"
  step "$label: Django backend suite on SQLite" integration/django "$py" runtests.py --db sqlite
  if [[ -n $upstream ]]; then
    step "$label: Django's own tests/tasks on SQLite" integration/django \
      "$py" upstream.py --db sqlite
  fi
  if pg_ready "$py"; then
    step "$label: Django backend suite on PostgreSQL" integration/django \
      "$py" runtests.py --db postgres
    if [[ -n $upstream ]]; then
      step "$label: Django's own tests/tasks on PostgreSQL" integration/django \
        "$py" upstream.py --db postgres
    fi
  elif [[ ${CI:-} == true || ${CI:-} == 1 ]]; then
    echo "CI=true but PostgreSQL is not reachable: $(tail -1 "$LOG_DIR/pg.err")"
    FAILED_STEPS+=("$label: PostgreSQL unreachable"); FAILED=$(( FAILED + 1 ))
  else
    say "$label: PostgreSQL not reachable, its suite is skipped ($(tail -1 "$LOG_DIR/pg.err"))"
  fi
  step "$label: examples/django_shop" examples/django_shop "$py" manage.py test --noinput
}

if [[ ${1:-} == --prepare ]]; then
  # `make test` runs this beside the main suite: the Django venvs' installs and the
  # upstream tests' download are network and disk work that need not wait for pytest.
  # Whatever fails here is tried again, and reported, by the real run.
  if py=$(find_python 3.11 "${ERRANDS_PY311:-}"); then
    ensure_venv .venv-django52 "$py" integration/requirements-django52.txt \
      examples/django_shop/requirements.txt
  fi
  if py=$(find_python 3.12 "${ERRANDS_PY312:-}") &&
     ensure_venv .venv-django6 "$py" integration/requirements-django6.txt \
       examples/django_shop/requirements.txt; then
    (cd integration/django && "$ROOT/.venv-django6/bin/python" upstream.py --fetch)
  fi
  if py=$(newer_python); then
    ensure_venv .venv-newer-python "$py" integration/requirements-newer-python.txt
  fi
  exit 0
fi

targets=("$@")
(( ${#targets[@]} )) || targets=(django52 django6 web newer-python)
for target in "${targets[@]}"; do
  case $target in
    django52)
      if py=$(find_python 3.11 "${ERRANDS_PY311:-}"); then
        django_stack "Django 5.2" .venv-django52 "$py" integration/requirements-django52.txt
      else
        FAILED_STEPS+=("Django 5.2: no Python 3.11 found (set ERRANDS_PY311)"); FAILED=$(( FAILED + 1 ))
      fi ;;
    django6)
      if py=$(find_python 3.12 "${ERRANDS_PY312:-}"); then
        django_stack "Django 6" .venv-django6 "$py" integration/requirements-django6.txt upstream
      else
        FAILED_STEPS+=("Django 6: no Python 3.12 found (set ERRANDS_PY312)"); FAILED=$(( FAILED + 1 ))
      fi ;;
    web)
      if [[ ! -x .venv/bin/python ]]; then make --no-print-directory .venv/.installed || exit 1; fi
      step "FastAPI: examples/fastapi_shop" examples/fastapi_shop "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider
      step "Flask: examples/flask_shop" examples/flask_shop "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider ;;
    newer-python)
      if ! py=$(newer_python); then
        FAILED_STEPS+=("newer Python: no Python 3.13 or 3.12 found (set ERRANDS_PY313)")
        FAILED=$(( FAILED + 1 ))
      elif ! ensure_venv .venv-newer-python "$py" integration/requirements-newer-python.txt; then
        FAILED_STEPS+=("newer Python: installing .venv-newer-python"); FAILED=$(( FAILED + 1 ))
      else
        version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        step "Python $version: errands' own tests (a subset)" "$ROOT" \
          "$ROOT/.venv-newer-python/bin/python" -m pytest -q -p no:cacheprovider \
          "${NEWER_PYTHON_TESTS[@]}"
      fi ;;
    *) echo "unknown target $target: choose django52, django6, web, newer-python"; exit 2 ;;
  esac
done

say "integrations finished in $(( $(date +%s) - started ))s"
for failed in "${FAILED_STEPS[@]}"; do echo "FAILED: $failed"; done
echo "integrations: $PASSED passed, $FAILED failed"
(( ${#FAILED_STEPS[@]} == 0 ))
