#!/usr/bin/env bash
# Wires kube-scheduler to the gpushare extender on a kubeadm control-plane node.
# Run it on EVERY control-plane node (as root). Pure bash + sed/awk/diff: no python needed.
#
#   install-scheduler-extender.sh [--dry-run] [--revert] [--extender-url URL]
#                                 [--no-doctor] [--root DIR]
#
# What it does:
#   1. writes /etc/kubernetes/gpushare/scheduler-config.yaml, a KubeSchedulerConfiguration
#      (kubescheduler.config.k8s.io/v1) whose extender points at URL
#      (default http://127.0.0.1:32766/gpushare-scheduler: the extender Service's NodePort);
#   2. backs up /etc/kubernetes/manifests/kube-scheduler.yaml to
#      /etc/kubernetes/gpushare/kube-scheduler.yaml.orig (whenever the manifest is not yet
#      patched: the first run, and again after `kubeadm upgrade` regenerated it);
#   3. patches the static pod manifest: adds --config=<that file> to the command, and a
#      read-only hostPath volume + mount of /etc/kubernetes/gpushare. kubelet restarts
#      kube-scheduler by itself when the manifest changes;
#   4. runs `gpushare doctor --role control-plane` when gpushare is on PATH.
# Running it again changes nothing (each edit is detected and skipped).
#
#   --dry-run          print the unified diff of what would change; write nothing
#   --revert           put the manifest back (from the backup when it still applies) and
#                      remove the files this script installed
#   --extender-url URL the extender's URL prefix (https:// sets enableHTTPS)
#   --no-doctor        do not run gpushare doctor at the end
#   --root DIR         operate on DIR/etc/kubernetes instead of /etc/kubernetes (tests,
#                      images); paths written INTO files stay host paths
#
# After `kubeadm upgrade`, run it again: kubeadm rewrites kube-scheduler.yaml without the flag.
# Exit status: 0 done (or nothing to do), 1 doctor reported problems, 2 usage or unsupported
# manifest layout (nothing written).
set -euo pipefail

ROOT=/
DRY_RUN=0
REVERT=0
DOCTOR=1
EXTENDER_URL=http://127.0.0.1:32766/gpushare-scheduler

# Paths as kube-scheduler and the host see them.
HOST_DIR=/etc/kubernetes/gpushare
HOST_CONFIG=$HOST_DIR/scheduler-config.yaml
CONFIG_FLAG=--config=$HOST_CONFIG
VOLUME_NAME=gpushare-config

die() { echo "install-scheduler-extender: $*" >&2; exit 2; }
note() { echo "install-scheduler-extender: $*"; }

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT=$2; shift 2 ;;
    --root=*) ROOT=${1#--root=}; shift ;;
    --extender-url) [ $# -ge 2 ] || die "--extender-url needs a URL"; EXTENDER_URL=$2; shift 2 ;;
    --extender-url=*) EXTENDER_URL=${1#--extender-url=}; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --revert) REVERT=1; shift ;;
    --no-doctor) DOCTOR=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

case "$EXTENDER_URL" in
  http://?*|https://?*) ;;
  *) die "--extender-url must start with http:// or https://: $EXTENDER_URL" ;;
esac
case "$EXTENDER_URL" in
  *[[:space:]\"\\]*) die "--extender-url must not contain spaces, quotes or backslashes" ;;
esac
EXTENDER_URL=${EXTENDER_URL%/}
ENABLE_HTTPS=false
case "$EXTENDER_URL" in https://*) ENABLE_HTTPS=true ;; esac

[ -d "$ROOT" ] || die "--root $ROOT is not a directory"
ROOT=${ROOT%/}
K8S_DIR=$ROOT/etc/kubernetes
MANIFEST=$K8S_DIR/manifests/kube-scheduler.yaml
GP_DIR=$ROOT$HOST_DIR
CONFIG=$ROOT$HOST_CONFIG
BACKUP=$GP_DIR/kube-scheduler.yaml.orig

[ -f "$MANIFEST" ] || die "no $MANIFEST: run this on a kubeadm control-plane node"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The KubeSchedulerConfiguration (same content as packaging/scheduler/scheduler-config.yaml).
render_config() {
  cat <<EOF
# Installed by gpushare's install-scheduler-extender.sh; kube-scheduler runs with
# $CONFIG_FLAG
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: /etc/kubernetes/scheduler.conf
extenders:
  - urlPrefix: "$EXTENDER_URL"
    filterVerb: filter
    prioritizeVerb: prioritize
    weight: 1
    bindVerb: bind
    enableHTTPS: $ENABLE_HTTPS
    nodeCacheCapable: true
    httpTimeout: 10s
    managedResources:
      - name: aliyun.com/gpu-mem
        ignoredByScheduler: false
    ignorable: false
EOF
}

# Whether the manifest already carries our flag.
is_patched() { grep -Eq -- "^[[:space:]]*- ${CONFIG_FLAG}[[:space:]]*\$" "$1"; }

# Prints the manifest $1 with the flag, the mount and the volume added (each only if missing).
# Works on the layout kubeadm writes (lists at their key's indent or indented further).
patch_manifest() {
  local has_flag=0 has_mount=0 has_volume=0
  is_patched "$1" && has_flag=1
  grep -Eq "^[[:space:]]*(- )?mountPath: ${HOST_DIR}[[:space:]]*\$" "$1" && has_mount=1
  grep -Eq "^[[:space:]]*path: ${HOST_DIR}[[:space:]]*\$" "$1" && has_volume=1
  awk -v flag="$CONFIG_FLAG" -v dir="$HOST_DIR" -v vol="$VOLUME_NAME" \
      -v has_flag="$has_flag" -v has_mount="$has_mount" -v has_volume="$has_volume" '
    function spaces(n,   s) { s = ""; while (n-- > 0) s = s " "; return s }
    function indent(l) { return match(l, /[^ ]/) ? RSTART - 1 : length(l) }
    function fail(msg) { print "install-scheduler-extender: unsupported kube-scheduler.yaml layout: " msg > "/dev/stderr"; failed = 1; exit 2 }
    { lines[NR] = $0 }
    END {
      if (failed) exit 2
      n = NR
      if (!has_flag) {
        cmd = 0
        for (i = 1; i <= n; i++) if (lines[i] ~ /^ *- kube-scheduler *$/) { cmd = i; break }
        if (!cmd) fail("no \"- kube-scheduler\" command item")
        item = spaces(indent(lines[cmd])) "- "
        j = cmd + 1
        while (j <= n && index(lines[j], item) == 1) j++
        ins[j] = ins[j] item flag "\n"
      }
      if (!has_mount) {
        k = 0
        for (i = 1; i <= n; i++) if (lines[i] ~ /^ *volumeMounts: *$/) { k = i; break }
        if (!k || lines[k + 1] !~ /^ *- /) fail("no volumeMounts list in the container")
        p = spaces(indent(lines[k + 1]))
        ins[k + 1] = ins[k + 1] p "- mountPath: " dir "\n" p "  name: " vol "\n" p "  readOnly: true\n"
      }
      if (!has_volume) {
        k = 0
        for (i = 1; i <= n; i++) if (lines[i] ~ /^ *volumes: *$/) { k = i; break }
        if (!k || lines[k + 1] !~ /^ *- /) fail("no volumes list in the pod spec")
        p = spaces(indent(lines[k + 1]))
        ins[k + 1] = ins[k + 1] p "- hostPath:\n" p "    path: " dir "\n" p "    type: DirectoryOrCreate\n" p "  name: " vol "\n"
      }
      for (i = 1; i <= n + 1; i++) {
        if (i in ins) printf "%s", ins[i]
        if (i <= n) print lines[i]
      }
    }' "$1"
}

# Prints the manifest $1 without what patch_manifest adds: the flag line, and every list item
# (mount or volume) whose own name is $VOLUME_NAME.
unpatch_manifest() {
  awk -v flag="$CONFIG_FLAG" -v vol="$VOLUME_NAME" '
    function indent(l) { return match(l, /[^ ]/) ? RSTART - 1 : length(l) }
    { lines[NR] = $0 }
    END {
      n = NR
      for (i = 1; i <= n; i++) {
        l = lines[i]
        if (l ~ /^ *- / && substr(l, indent(l) + 3) == flag) { drop[i] = 1; continue }
        if (l !~ /^ *(- )?name: / ) continue
        rest = l; sub(/^ *(- )?name: */, "", rest); sub(/ *$/, "", rest)
        if (rest != vol) continue
        # the item this name belongs to starts at a "- " two columns left of the key
        key = (l ~ /^ *- /) ? indent(l) + 2 : indent(l)
        s = i
        while (s >= 1 && !(indent(lines[s]) == key - 2 && substr(lines[s], key - 1, 2) == "- ")) s--
        if (s < 1) continue
        e = s + 1
        while (e <= n && indent(lines[e]) > key - 2) e++
        for (j = s; j < e; j++) drop[j] = 1
      }
      for (i = 1; i <= n; i++) if (!(i in drop)) print lines[i]
    }' "$1"
}

# Shows what changes from $1 (or nothing, when it does not exist) to $2, labelled with $3.
show_diff() {
  local from=$1 to=$2 label=$3
  [ -e "$from" ] || from=/dev/null
  if command -v diff >/dev/null; then
    diff -u --label "a$label" --label "b$label" "$from" "$to" || [ $? -eq 1 ]
  else
    echo "--- $label (diff(1) not found; new content follows)"
    cat "$to"
  fi
}

# Replaces $1 with the content of $2 atomically, keeping $1's mode and owner. The temporary
# file starts with a dot: kubelet ignores dot files in the static pod directory.
replace_file() {
  local target=$1 content=$2 tmp
  tmp=$(dirname "$target")/.$(basename "$target").gpushare.tmp
  if [ -e "$target" ]; then cp -p "$target" "$tmp"; else : > "$tmp"; chmod 0644 "$tmp"; fi
  cat "$content" > "$tmp"
  mv -f "$tmp" "$target"
}

run_doctor() {
  [ "$DOCTOR" = 1 ] || return 0
  if ! command -v gpushare >/dev/null; then
    note "gpushare is not on PATH: skipped 'gpushare doctor --role control-plane' (run it once the binary is installed)"
    return 0
  fi
  local args=(doctor --role control-plane --scheduler-config "$HOST_CONFIG")
  [ "$ROOT" = "" ] || args+=(--root "$ROOT")
  note "running gpushare ${args[*]}"
  if ! gpushare "${args[@]}"; then
    note "the scheduler is configured, but gpushare doctor reports problems (above)"
    exit 1
  fi
}

if [ "$REVERT" = 1 ]; then
  if ! is_patched "$MANIFEST"; then
    note "$MANIFEST does not use $HOST_CONFIG: nothing to revert"
    restored=""
  else
    restored=$WORK/kube-scheduler.yaml
    if [ -f "$BACKUP" ] && patch_manifest "$BACKUP" > "$WORK/expected" && cmp -s "$WORK/expected" "$MANIFEST"; then
      cp "$BACKUP" "$restored"
    else
      note "the manifest changed since the backup was taken: removing the gpushare edits instead of restoring $BACKUP"
      unpatch_manifest "$MANIFEST" > "$restored"
    fi
  fi
  if [ "$DRY_RUN" = 1 ]; then
    [ -z "$restored" ] || show_diff "$MANIFEST" "$restored" /etc/kubernetes/manifests/kube-scheduler.yaml
    [ ! -e "$CONFIG" ] || note "would remove $CONFIG and $BACKUP"
    note "dry run: nothing written"
    exit 0
  fi
  if [ -n "$restored" ]; then
    replace_file "$MANIFEST" "$restored"
    note "restored $MANIFEST (kubelet restarts kube-scheduler without the extender)"
  fi
  rm -f "$CONFIG" "$BACKUP"
  rmdir "$GP_DIR" 2>/dev/null || true
  exit 0
fi

if grep -Eq -- '^[[:space:]]*- --config[=[:space:]]' "$MANIFEST" && ! is_patched "$MANIFEST"; then
  die "kube-scheduler already runs with its own --config ($(grep -Eo -- '--config[= ][^[:space:]]+' "$MANIFEST" | head -n1)); add the extenders block of packaging/scheduler/scheduler-config.yaml to that file by hand"
fi

render_config > "$WORK/scheduler-config.yaml"
patch_manifest "$MANIFEST" > "$WORK/kube-scheduler.yaml" || exit 2

config_changes=1
[ -f "$CONFIG" ] && cmp -s "$CONFIG" "$WORK/scheduler-config.yaml" && config_changes=0
manifest_changes=1
cmp -s "$MANIFEST" "$WORK/kube-scheduler.yaml" && manifest_changes=0

if [ "$DRY_RUN" = 1 ]; then
  [ "$config_changes" = 0 ] || show_diff "$CONFIG" "$WORK/scheduler-config.yaml" "$HOST_CONFIG"
  [ "$manifest_changes" = 0 ] || show_diff "$MANIFEST" "$WORK/kube-scheduler.yaml" /etc/kubernetes/manifests/kube-scheduler.yaml
  [ "$config_changes$manifest_changes" != 00 ] || note "already installed: no change"
  note "dry run: nothing written"
  exit 0
fi

mkdir -p "$GP_DIR"
if [ "$config_changes" = 1 ]; then
  replace_file "$CONFIG" "$WORK/scheduler-config.yaml"
  note "wrote $CONFIG (extender $EXTENDER_URL)"
fi
if [ "$manifest_changes" = 1 ]; then
  if ! is_patched "$MANIFEST"; then
    cp -p "$MANIFEST" "$BACKUP"
    note "backed up $MANIFEST to $BACKUP"
  fi
  replace_file "$MANIFEST" "$WORK/kube-scheduler.yaml"
  note "patched $MANIFEST (kubelet restarts kube-scheduler with $CONFIG_FLAG)"
fi
[ "$config_changes$manifest_changes" != 00 ] || note "already installed: no change"
run_doctor
