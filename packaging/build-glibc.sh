#!/usr/bin/env bash
# Builds target/gpushare-glibc: gpushare dynamically linked against glibc 2.17 (so it runs on
# every glibc distribution since 2014) with the NVML backend, using cargo-zigbuild. zig and
# cargo-zigbuild come from PyPI and are installed here when missing. Then proves with
# `objdump -T` that no glibc symbol version newer than 2.17 is required, and prints the size.
#
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (default target), PIP (default pip3),
# CI (set: pass --locked).
set -euo pipefail

cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
PIP=${PIP:-pip3}
TARGET_TRIPLE=x86_64-unknown-linux-gnu
GLIBC_FLOOR=2.17
TARGET_DIR=${CARGO_TARGET_DIR:-target}
OUT=target/gpushare-glibc
LOCKED=()
[ -n "${CI:-}" ] && LOCKED=(--locked)

say() { echo "glibc: $*"; }

if ! command -v python3 >/dev/null; then
  say "needs python3 and pip to install zig and cargo-zigbuild from PyPI"; exit 1
fi
# zig: the `ziglang` wheel ships the compiler; cargo-zigbuild finds it through `python3 -m ziglang`.
if ! command -v zig >/dev/null && ! python3 -c 'import ziglang' 2>/dev/null; then
  say "installing ziglang from PyPI"
  "$PIP" install --quiet ziglang
fi
if ! command -v cargo-zigbuild >/dev/null; then
  say "installing cargo-zigbuild from PyPI"
  "$PIP" install --quiet cargo-zigbuild
  hash -r
fi
command -v cargo-zigbuild >/dev/null || { say "cargo-zigbuild is not on PATH after pip install (check pip's script directory)"; exit 1; }

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
offenders=$(objdump -T "$OUT" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -u -V |
  awk -v floor="$GLIBC_FLOOR" '{
      split(substr($0, 7), v, "."); split(floor, f, ".");
      if (v[1] + 0 > f[1] + 0 || (v[1] + 0 == f[1] + 0 && v[2] + 0 > f[2] + 0)) print
    }')
if [ -n "$offenders" ]; then
  say "$OUT requires glibc symbol versions newer than $GLIBC_FLOOR:"
  for v in $offenders; do
    echo "  $v: $(objdump -T "$OUT" | grep -w "$v" | awk '{print $NF}' | tr '\n' ' ')"
  done
  exit 1
fi
newest=$(objdump -T "$OUT" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -u -V | tail -1)
size=$(stat -c %s "$OUT")
say "$OUT: newest glibc symbol version required ${newest:-none} (floor $GLIBC_FLOOR), $((size / 1024 / 1024)) MiB ($size bytes)"
"$OUT" version
