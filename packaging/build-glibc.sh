#!/usr/bin/env bash
# Builds gpushare dynamically linked against glibc 2.17 (so it runs on every glibc distribution
# since 2014) with the NVML backend, using cargo-zigbuild: target/gpushare-glibc (x86_64) or,
# with GLIBC_ARCH=aarch64, target/gpushare-glibc-aarch64 (GH200/GB200 Grace nodes, Jetson).
# zig and cargo-zigbuild come from PyPI (packaging/tools.sh puts them in .venv when they are
# missing). Then proves with readelf that no glibc symbol version newer than 2.17 is required,
# prints the size, and runs `version` (under qemu-aarch64 for aarch64 when it is installed).
#
# Environment: GLIBC_ARCH (x86_64 | aarch64, default x86_64), CARGO (default cargo),
# CARGO_TARGET_DIR (default target), CI (set: pass --locked).
set -euo pipefail

cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
ARCH=${GLIBC_ARCH:-x86_64}
case "$ARCH" in
  x86_64) OUT=target/gpushare-glibc ;;
  aarch64) OUT=target/gpushare-glibc-aarch64 ;;
  *) echo "glibc: GLIBC_ARCH must be x86_64 or aarch64, not $ARCH"; exit 1 ;;
esac
TARGET_TRIPLE=$ARCH-unknown-linux-gnu
GLIBC_FLOOR=2.17
TARGET_DIR=${CARGO_TARGET_DIR:-target}
LOCKED=()
[ -n "${CI:-}" ] && LOCKED=(--locked)

say() { echo "glibc: $*"; }

# zig: the `ziglang` wheel ships the compiler; cargo-zigbuild finds it through `python3 -m ziglang`.
if ! command -v cargo-zigbuild >/dev/null; then
  say "cargo-zigbuild not on PATH: installing the pinned tools into .venv (packaging/tools.sh)"
  ./packaging/tools.sh
  export PATH=$PWD/.venv/bin:$PATH
fi
command -v cargo-zigbuild >/dev/null || { say "cargo-zigbuild is not on PATH after packaging/tools.sh"; exit 1; }

if command -v rustup >/dev/null; then
  rustup target list --installed | grep -qx "$TARGET_TRIPLE" || rustup target add "$TARGET_TRIPLE"
fi

say "cargo zigbuild --release --target $TARGET_TRIPLE.$GLIBC_FLOOR"
"$CARGO" zigbuild "${LOCKED[@]}" --release --target "$TARGET_TRIPLE.$GLIBC_FLOOR"

BUILT="$TARGET_DIR/$TARGET_TRIPLE/release/gpushare"
[ -x "$BUILT" ] || { say "expected $BUILT after the build"; exit 1; }
mkdir -p "$(dirname "$OUT")"
cp "$BUILT" "$OUT"

# Every GLIBC_x.y version the binary requires; anything above the floor is an offender.
offenders=$(readelf --dyn-syms -W "$OUT" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -u -V |
  awk -v floor="$GLIBC_FLOOR" '{
      split(substr($0, 7), v, "."); split(floor, f, ".");
      if (v[1] + 0 > f[1] + 0 || (v[1] + 0 == f[1] + 0 && v[2] + 0 > f[2] + 0)) print
    }')
if [ -n "$offenders" ]; then
  say "$OUT requires glibc symbol versions newer than $GLIBC_FLOOR:"
  for v in $offenders; do
    echo "  $v: $(readelf --dyn-syms -W "$OUT" | grep -o "[A-Za-z0-9_]*@$v" | tr '\n' ' ')"
  done
  exit 1
fi
newest=$(readelf --dyn-syms -W "$OUT" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -u -V | tail -1)
size=$(stat -c %s "$OUT")
say "$OUT: newest glibc symbol version required ${newest:-none} (floor $GLIBC_FLOOR), $((size / 1024 / 1024)) MiB ($size bytes)"
if [ "$ARCH" = "$(uname -m)" ]; then
  "$OUT" version
elif command -v "qemu-$ARCH-static" >/dev/null && [ -d "/usr/$ARCH-linux-gnu/lib" ]; then
  "qemu-$ARCH-static" -L "/usr/$ARCH-linux-gnu" "$OUT" version
else
  say "not running $OUT: no qemu-$ARCH-static with /usr/$ARCH-linux-gnu (make qemu-arm64 installs and runs them)"
fi
