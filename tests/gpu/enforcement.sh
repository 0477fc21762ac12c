#!/bin/sh
# The driver's per-cgroup GPU memory limits on a real GPU (make test-gpu; run as root on a node
# with driver R615+ and cgroup v2). Two "containers" on the first GPU, each a cgroup of its own
# under /sys/fs/cgroup/gpushare-test with a process in it; the memory-limit hook, run as the
# runtime runs it (the OCI state on stdin), gives the first one 4 GiB:
#   - nvidia-smi memory-limits --get shows soft = hard = 4096 MiB on its cgroup;
#   - inside it, CUDA sees 4 GiB as the GPU's total (nvidia-smi inside shows the limit);
#     3 GiB fit, 2 GiB more run out of memory;
#   - the other container, without a limit, allocates 6 GiB.
# Exit 0 when all hold, 77 when the machine cannot run it (the reason on stderr), else 1.
# GPUSHARE names the gpushare binary (default target/debug/gpushare).
set -eu
GPUSHARE=${GPUSHARE:-target/debug/gpushare}
HERE=$(cd "$(dirname "$0")" && pwd)
skip() { echo "cannot run here: $*" >&2; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root (setting limits does)"
command -v nvidia-smi >/dev/null || skip "no nvidia-smi"
[ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] || skip "/sys/fs/cgroup is not cgroup v2"
major=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 | cut -d. -f1)
[ "$major" -ge 615 ] || skip "driver $major is older than R615"
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
MIG=$(nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader -i "$UUID" 2>/dev/null || true)
[ "$MIG" != Enabled ] || skip "GPU $UUID is in MIG mode"

WORK=$(mktemp -d)
cc -O1 -o "$WORK/cuda_alloc" "$HERE/cuda_alloc.c" -ldl || skip "no C compiler"
ROOT=/sys/fs/cgroup/gpushare-test
A=$ROOT/ctr-a
B=$ROOT/ctr-b
PIDS=""
cleanup() {
  for cg in "$A" "$B"; do
    [ -d "$cg" ] && nvidia-smi memory-limits --set -n "$cg" --soft-limit 0 --hard-limit max -i "$UUID" >/dev/null 2>&1 || true
  done
  for p in $PIDS; do kill "$p" 2>/dev/null || true; done
  sleep 1
  rmdir "$A" "$B" "$ROOT" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$ROOT"
# The dmem backend needs dmem files on the leaves: enable the controller down to them.
if grep -qw dmem /sys/fs/cgroup/cgroup.controllers; then
  grep -qw dmem /sys/fs/cgroup/cgroup.subtree_control || echo +dmem > /sys/fs/cgroup/cgroup.subtree_control
  echo +dmem > "$ROOT/cgroup.subtree_control"
fi
mkdir -p "$A" "$B"

# A container's first process, as the runtime has it when createRuntime hooks run.
sleep 600 & PID_A=$!; PIDS="$PIDS $PID_A"; echo "$PID_A" > "$A/cgroup.procs"
sleep 600 & PID_B=$!; PIDS="$PIDS $PID_B"; echo "$PID_B" > "$B/cgroup.procs"

LIMIT=$((4 << 30))
printf '{"ociVersion":"1.2.0","id":"ctr-a","status":"created","pid":%s,"bundle":""}' "$PID_A" |
  "$GPUSHARE" cdi-hook memory-limit --limit "$UUID=$LIMIT" --state-dir "$WORK/state" ||
  fail "the hook refused (its line above)"

got=$(nvidia-smi memory-limits --get -n "$A" -i "$UUID")
echo "$got"
echo "$got" | grep -qi "soft limit: 4096 MiB" || fail "soft limit is not 4096 MiB"
echo "$got" | grep -qi "hard limit: 4096 MiB" || fail "hard limit is not 4096 MiB"

# Inside A: nvidia-smi and CUDA see the limit; past it, out of memory.
in_a() { sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$A" "$@"; }
in_b() { sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$B" "$@"; }
total=$(in_a nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$UUID")
echo "nvidia-smi in ctr-a: memory.total $total MiB"
[ "$total" -le 4096 ] || fail "nvidia-smi inside the limited container shows $total MiB"
set +e
out=$(CUDA_VISIBLE_DEVICES=$UUID in_a "$WORK/cuda_alloc" 3072 2048); code=$?
set -e
echo "$out"
echo "$out" | grep -q "^total=4096 " || fail "CUDA inside ctr-a does not see 4096 MiB as the total"
echo "$out" | grep -q "alloc 3072 ok" || fail "3 GiB did not fit under the 4 GiB limit"
[ "$code" = 2 ] && echo "$out" | grep -q "alloc 2048 out-of-memory" || fail "2 GiB more did not run out of memory (exit $code)"

out=$(CUDA_VISIBLE_DEVICES=$UUID in_b "$WORK/cuda_alloc" 6144) || fail "ctr-b without a limit could not allocate 6 GiB: $out"
echo "$out"
echo "enforcement on $UUID: ok"
