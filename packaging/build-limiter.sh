#!/usr/bin/env bash
# Builds the CUDA memory limiter (crates/limiter, libgpushare_limiter.so) dynamically linked
# against glibc 2.17, like gpushare-glibc, with cargo-zigbuild: target/limiter/<arch>/.
# Then checks what a preloaded library must be:
#   - no glibc symbol version newer than 2.17 is required (objdump -T / readelf);
#   - it exports exactly dlsym and the hooks of crates/limiter/src/symbols.rs (nm -D);
#   - no constructor but the Rust standard library's argv capture (one .init_array entry,
#     no DT_INIT function of its own, no .preinit_array);
# and prints its size and the libraries it needs.
#
# On the machine's own architecture it then runs the limiter's tests against this very build
# (GPUSHARE_LIMITER_LIB): what ships is what the tests preload.
#
# Environment: GLIBC_ARCH (x86_64 | aarch64, default x86_64), CARGO (default cargo),
# CARGO_TARGET_DIR (default target), CI (set: pass --locked), LIMITER_NO_TESTS (set: skip
# the test run).
set -euo pipefail

cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
ARCH=${GLIBC_ARCH:-x86_64}
case "$ARCH" in
  x86_64 | aarch64) ;;
  *) echo "limiter: GLIBC_ARCH must be x86_64 or aarch64, not $ARCH"; exit 1 ;;
esac
TARGET_TRIPLE=$ARCH-unknown-linux-gnu
GLIBC_FLOOR=2.17
TARGET_DIR=${CARGO_TARGET_DIR:-target}
OUT_DIR=target/limiter/$ARCH
OUT=$OUT_DIR/libgpushare_limiter.so
LOCKED=()
[ -n "${CI:-}" ] && LOCKED=(--locked)

say() { echo "limiter: $*"; }

if ! command -v cargo-zigbuild >/dev/null; then
  say "cargo-zigbuild not on PATH: installing the pinned tools into .venv (packaging/tools.sh)"
  ./packaging/tools.sh
  export PATH=$PWD/.venv/bin:$PATH
fi
command -v cargo-zigbuild >/dev/null || { say "cargo-zigbuild is not on PATH after packaging/tools.sh"; exit 1; }
if command -v rustup >/dev/null; then
  rustup target list --installed | grep -qx "$TARGET_TRIPLE" || rustup target add "$TARGET_TRIPLE"
fi

say "cargo zigbuild --release -p gpushare-limiter --lib --target $TARGET_TRIPLE.$GLIBC_FLOOR"
"$CARGO" zigbuild "${LOCKED[@]}" --release -p gpushare-limiter --lib --target "$TARGET_TRIPLE.$GLIBC_FLOOR"

BUILT="$TARGET_DIR/$TARGET_TRIPLE/release/libgpushare_limiter.so"
[ -f "$BUILT" ] || { say "expected $BUILT after the build"; exit 1; }
mkdir -p "$OUT_DIR"
cp "$BUILT" "$OUT"

# The glibc floor: every GLIBC_x.y version the library requires, none above 2.17.
required=$(objdump -T "$OUT" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -u -V)
offenders=$(echo "$required" | awk -v floor="$GLIBC_FLOOR" 'NF {
    split(substr($0, 7), v, "."); split(floor, f, ".");
    if (v[1] + 0 > f[1] + 0 || (v[1] + 0 == f[1] + 0 && v[2] + 0 > f[2] + 0)) print
  }')
if [ -n "$offenders" ]; then
  say "$OUT requires glibc symbol versions newer than $GLIBC_FLOOR:"
  for v in $offenders; do
    echo "  $v: $(objdump -T "$OUT" | grep "($v)" | awk '{print $NF}' | tr '\n' ' ')"
  done
  exit 1
fi

# The exports: dlsym and the hooked! entries of the symbol table, nothing else.
expected=$( (echo dlsym; sed -n 's/^ *hooked!([A-Za-z]*, *[a-z_]*::\([A-Za-z0-9_]*\)),$/\1/p' crates/limiter/src/symbols.rs) | sort)
exported=$(nm -D --defined-only "$OUT" | awk '{print $3}' | sort)
if [ "$expected" != "$exported" ]; then
  say "$OUT exports other symbols than dlsym and its hooks:"
  diff <(echo "$expected") <(echo "$exported") || true
  exit 1
fi

# Constructors: the Rust standard library's argv capture is the one .init_array entry; no
# DT_INIT function, no .preinit_array.
dynamic=$(readelf -d -W "$OUT")
if grep -q '(PREINIT_ARRAY)' <<<"$dynamic"; then say "$OUT has a .preinit_array"; exit 1; fi
init_size=$(awk '/\(INIT_ARRAYSZ\)/ {print $(NF-1)}' <<<"$dynamic")
if [ "${init_size:-0}" -gt 8 ]; then
  say "$OUT has ${init_size} bytes of .init_array: a constructor besides the standard library's"
  exit 1
fi
if grep -q '(INIT) ' <<<"$dynamic"; then
  # A DT_INIT is the C runtime's _init stub at most; it must not call into the library.
  say "note: $OUT has a DT_INIT (the C runtime's _init)"
fi

size=$(stat -c %s "$OUT")
needed=$(awk '/\(NEEDED\)/ {gsub(/[][]/, "", $NF); print $NF}' <<<"$dynamic" | tr '\n' ' ')
say "$OUT: newest glibc symbol version $(echo "$required" | tail -1) (floor $GLIBC_FLOOR), $(echo "$exported" | wc -l) exports, ${init_size:-0} bytes of .init_array, $((size / 1024)) KiB, needs: $needed"

if [ "$ARCH" = "$(uname -m)" ] && [ -z "${LIMITER_NO_TESTS:-}" ]; then
  say "the limiter's tests (crates/limiter/tests) with $OUT preloaded"
  GPUSHARE_LIMITER_LIB="$PWD/$OUT" "$CARGO" test "${LOCKED[@]}" -p gpushare-limiter --test limiter
else
  say "not running the tests against $OUT (another architecture, or LIMITER_NO_TESTS)"
fi
