#!/usr/bin/env bash
# Proves the arm64 binaries work: runs `version` and `demo` (sandbox cluster, extender,
# device plugin, fake GPUs, all in one process) of each under qemu-aarch64 user-mode emulation.
#   $1  the static aarch64 musl binary    (make static-arm64)
#   $2  the aarch64 glibc 2.17 binary      (make glibc-arm64), run with Debian's aarch64 glibc;
#       optional: CI runs the static one only (the release workflow builds and runs both)
# Needs Debian's qemu-user-static, and libc6-arm64-cross for the glibc binary's loader and libc.
set -euo pipefail
cd "$(dirname "$0")/.."

STATIC_BIN=${1:?static aarch64 binary}
GLIBC_BIN=${2:-}
QEMU=$(command -v qemu-aarch64-static || command -v qemu-aarch64 || true)
SYSROOT=/usr/aarch64-linux-gnu
say() { echo "qemu-arm64: $*"; }

[ -n "$QEMU" ] || { say "needs qemu-aarch64 (apt-get install -y qemu-user-static)"; exit 1; }
[ -z "$GLIBC_BIN" ] || [ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ] || { say "needs $SYSROOT (apt-get install -y libc6-arm64-cross)"; exit 1; }

# $1 label, $2 binary, rest: qemu options. Checks what the binary says about itself, then the demo.
check() {
  local label=$1 bin=$2 linkage=$3; shift 3
  [ -x "$bin" ] || { say "$bin missing: build it first"; exit 1; }
  file "$bin" | grep -q 'ARM aarch64' || { file "$bin"; say "$bin is not an aarch64 ELF"; exit 1; }
  local out
  out=$("$QEMU" "$@" "$bin" version)
  echo "$out" | sed "s/^/  [$label] /"
  grep -qx "gpushare $GPUSHARE_VERSION_EXPECTED" <<<"$out" || { say "$label: version is not $GPUSHARE_VERSION_EXPECTED"; exit 1; }
  grep -q '^target: aarch64-unknown-linux-' <<<"$out" || { say "$label: not an aarch64 target"; exit 1; }
  grep -qx "linkage: $linkage" <<<"$out" || { say "$label: linkage is not $linkage"; exit 1; }
  local demo
  demo=$("$QEMU" "$@" "$bin" demo 2>&1) || { echo "$demo" | tail -20; say "$label: demo failed"; exit 1; }
  echo "$demo" | tail -1 | sed "s/^/  [$label] /"
  grep -q '^All [0-9]* expectations held\.$' <<<"$demo" || { echo "$demo" | tail -20; say "$label: demo did not hold"; exit 1; }
}

GPUSHARE_VERSION_EXPECTED=${GPUSHARE_VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)}
check static "$STATIC_BIN" static
if [ -z "$GLIBC_BIN" ]; then
  say "the static arm64 binary ran version and demo under $("$QEMU" --version | head -1)"
  exit 0
fi
check glibc "$GLIBC_BIN" dynamic -L "$SYSROOT"
say "both arm64 binaries ran version and demo under $("$QEMU" --version | head -1)"
