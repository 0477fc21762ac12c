#!/usr/bin/env bash
# `cargo test` with the given arguments, then the count a reader needs: how many tests passed,
# and how many of those were SKIPPED (each printed `SKIPPED: <test>: <why>` on a line of its
# own: a client it drives is missing) and so checked nothing. libtest counts a skipped test as
# passed; this summary does not.
#
#   --require-tests   fail when no test ran and checked something (make test-cluster,
#                     make test-gpu: an empty filter or a run of skips is a failure)
set -uo pipefail
require=0
if [ "${1:-}" = --require-tests ]; then
  require=1
  shift
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"${CARGO:-cargo}" test "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9][0-9]*\) passed.*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')
skipped=$(grep -c '^SKIPPED: ' "$log")
echo
if [ "$skipped" = 0 ]; then
  echo "tests: $passed passed, none SKIPPED"
else
  echo "tests: $passed passed, $skipped of them SKIPPED (they checked nothing):"
  grep '^SKIPPED: ' "$log" | sort | sed 's/^/  /'
fi
[ "$rc" = 0 ] || exit "$rc"
if [ $require = 1 ] && [ $((passed - skipped)) -le 0 ]; then
  echo "tests: FAILED: no test ran and checked anything ($passed passed, $skipped skipped): $*" >&2
  exit 1
fi
