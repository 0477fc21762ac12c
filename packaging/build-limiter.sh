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

# Constructors: the Rust standard library's argv capture is the one .init_array entry (on
# aarch64 also compiler-rt's CPU feature detection for atomics, init_have_lse_atomics and
# __init_cpu_features: three); no DT_INIT function, no .preinit_array.
dynamic=$(readelf -d -W "$OUT")
if grep -q '(PREINIT_ARRAY)' <<<"$dynamic"; then say "$OUT has a .preinit_array"; exit 1; fi
init_size=$(awk '/\(INIT_ARRAYSZ\)/ {print $(NF-1)}' <<<"$dynamic")
allowed=8
[ "$ARCH" = aarch64 ] && allowed=24
if [ "${init_size:-0}" -gt "$allowed" ]; then
  say "$OUT has ${init_size} bytes of .init_array (at most $allowed expected): a constructor besides the toolchain's"
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
elif [ -z "${LIMITER_NO_TESTS:-}" ] && command -v "qemu-$ARCH-static" >/dev/null && [ -d "/usr/$ARCH-linux-gnu/lib" ]; then
  # Another architecture: the fakes and the probe cross-built with zig's C compiler, run
  # under qemu-user with the library preloaded (every route, the limit, the views; and the
  # dlsym trampoline with a wrapper that looks up RTLD_NEXT).
  say "a smoke run under qemu-$ARCH-static"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cp crates/limiter/tests/c/*.c "$work"
  zcc() { (cd "$work" && python3 -m ziglang cc -target "$ARCH-linux-gnu.$GLIBC_FLOOR" "$@"); }
  export PATH=$PWD/.venv/bin:$PATH
  zcc -shared -fPIC -O1 -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_cuda.c -lpthread
  zcc -shared -fPIC -O1 -Wl,-Bsymbolic -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
  zcc -shared -fPIC -O1 -o libnext.so next.c -ldl
  zcc -shared -fPIC -O1 -o libwrap.so wrap.c -ldl
  zcc -O1 -o wrapcheck wrapcheck.c -L. -lwrap -Wl,-rpath,'$ORIGIN'
  zcc -O1 -o probe probe.c -L. -lnext -ldl -Wl,-rpath,'$ORIGIN'
  mkdir -p "$work/root/state"
  printf 'gpushare-limiter-limits 1\nGPU-00000000-0000-0000-0000-000000000001 4294967296\n' >"$work/root/limits"
  qemu=("qemu-$ARCH-static" -L "/usr/$ARCH-linux-gnu")
  LD_PRELOAD="$PWD/$OUT" "${qemu[@]}" "$work/wrapcheck" >/dev/null ||
    { say "dlsym(RTLD_NEXT) from a wrapper failed with the limiter preloaded (exit $?)"; exit 1; }
  for route in dlsym-handle dlsym-default interposer-next getproc:11030 getproc2:12080 getproc2-ptsz:12080; do
    got=$(LD_PRELOAD="$PWD/$OUT" GPUSHARE_LIMITER_ROOT="$work/root" "${qemu[@]}" "$work/probe" "$route" \
      which cuMemAlloc ctx 0 alloc 4294967296 alloc 1 info nvml 0 | tr '\n' ' ')
    want="which cuMemAlloc libgpushare_limiter.so cuMemAlloc_v2 ctx 0 0 alloc 4294967296 0 alloc 1 2 info 0 0 4294967296 nvml 0 4294967296 0 4294967296 "
    [ "$got" = "$want" ] || { say "route $route under qemu: got '$got', want '$want'"; exit 1; }
  done
  say "under qemu-$ARCH-static: the trampoline and 6 routes hold the 4 GiB limit"
else
  say "not running the tests against $OUT (another architecture without qemu-$ARCH-static and /usr/$ARCH-linux-gnu, or LIMITER_NO_TESTS)"
fi
