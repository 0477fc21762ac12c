#!/usr/bin/env bash
# Installs the clients written by others that the tests drive, each pinned:
#   - tests/clients/requirements.txt (grpcio, grpcio-tools, helm-python-sdk, kubernetes-validate)
#     into $VENV (.venv);
#   - tests/clients/requirements-checkov.txt (checkov) into .venv-checkov (a venv of its own);
#   - promtool (Debian package `prometheus`) is not installed here: only reported when missing.
# A venv whose installed versions already equal the pins is left alone (nothing is fetched,
# nothing written), so `make test` costs nothing once they are in.
#
# `make clients` runs it strictly: any failure fails. `make test` runs it with --best-effort:
# a client that cannot be installed (no python3, no venv module, no network) is reported
# loudly, and each test that needs it prints `SKIPPED: <test>: <why>` instead of running.
# Under CI (CI set, not 0/false) --best-effort is strict too.
set -uo pipefail
cd "${0%/*}/../.."
VENV=${VENV:-.venv}
CHECKOV_VENV=${CHECKOV_VENV:-.venv-checkov}
strict=1
if [ "${1:-}" = --best-effort ]; then
  case "${CI:-}" in ""|0|false) strict=0 ;; esac
fi

problems=0
trouble() {
  if [ $strict = 1 ]; then
    echo "clients: $*" >&2
    exit 1
  fi
  problems=$((problems + 1))
  echo "clients: NOT INSTALLED: $*; the tests that drive it print SKIPPED" >&2
}

# True when every `name==version` pin of $2 is what the interpreter $1 has installed.
pinned() {
  "$1" - "$2" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
}

# venv DIR REQUIREMENTS: DIR holds exactly the pins of REQUIREMENTS.
venv() {
  local dir=$1 req=$2
  if [ -x "$dir/bin/python3" ] && pinned "$dir/bin/python3" "$req"; then
    echo "clients: $dir has $req"
    return
  fi
  if ! command -v python3 >/dev/null; then
    trouble "python3 is missing ($req; apt-get install python3 python3-venv)"
    return
  fi
  echo "clients: installing $req into $dir (from PyPI)"
  if ! { [ -x "$dir/bin/python3" ] || python3 -m venv "$dir"; }; then
    trouble "cannot make the venv $dir (apt-get install python3-venv)"
    return
  fi
  if ! "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$req"; then
    trouble "pip cannot install $req into $dir (offline?)"
  fi
}

venv "$VENV" tests/clients/requirements.txt
venv "$CHECKOV_VENV" tests/clients/requirements-checkov.txt
if ! command -v "${GPUSHARE_TEST_PROMTOOL:-promtool}" >/dev/null; then
  # Not installed here: a system package (root, apt) is the machine owner's call.
  echo "clients: NOT INSTALLED: promtool (apt-get install prometheus, or set GPUSHARE_TEST_PROMTOOL); the tests that drive it print SKIPPED" >&2
  problems=$((problems + 1))
  [ $strict = 1 ] && exit 1
fi
[ $problems = 0 ] || echo "clients: $problems client(s) missing: see the SKIPPED lines of the test run" >&2
exit 0
