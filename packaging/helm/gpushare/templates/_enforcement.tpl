{{/*
GPU memory enforcement (devicePlugin.enforcement, docs/enforcement.md) on both node roles.
With auto or driver: the node agent installs itself as the CDI hook at
/var/lib/gpushare/bin/gpushare (a host directory, the same path on both sides), records the
limits the hook sets in /var/run/gpushare/limits, reads the host's cgroup tree at
/host/sys/fs/cgroup, and (device-plugin path) writes the specs carrying the hook into the
host's /var/run/cdi, mounted at /run/gpushare/limit-cdi. With auto or limiter: the node agent
installs the CUDA memory limiter the image carries (/usr/local/lib/gpushare) into the host's
/var/lib/gpushare/limiter and writes each container's limits and state under the host's
/run/gpushare/limiter (a tmpfs), both at the same paths (the mounts it hands containers name
host paths). With mps or none: only the flag.
*/}}
{{- define "gpushare.enforcement.on" -}}
{{- if has .Values.devicePlugin.enforcement (list "auto" "driver") }}true{{ end -}}
{{- end -}}

{{- define "gpushare.limiter.on" -}}
{{- if has .Values.devicePlugin.enforcement (list "auto" "limiter") }}true{{ end -}}
{{- end -}}

{{/* Whether the node roles mount host directories for enforcement (the driver's or the limiter's). */}}
{{- define "gpushare.enforcement.host" -}}
{{- if or (include "gpushare.enforcement.on" .) (include "gpushare.limiter.on" .) }}true{{ end -}}
{{- end -}}

{{- define "gpushare.enforcement.args" -}}
- --enforcement={{ .Values.devicePlugin.enforcement }}
{{- if include "gpushare.enforcement.on" . }}
- --enforcement-hook=/var/lib/gpushare/bin/gpushare
- --enforcement-install-hook
- --enforcement-state-dir=/var/run/gpushare/limits
- --enforcement-cdi-dir=/run/gpushare/limit-cdi
- --cgroup-root=/host/sys/fs/cgroup
{{- end }}
{{- if include "gpushare.limiter.on" . }}
- --limiter-library=/usr/local/lib/gpushare/libgpushare_limiter.so
- --limiter-dir=/var/lib/gpushare/limiter
- --limiter-run-dir=/run/gpushare/limiter
{{- end }}
{{- end -}}

{{- define "gpushare.enforcement.volumeMounts" -}}
{{- if include "gpushare.enforcement.on" . }}
# the hook the container runtime runs, installed here by the node agent
- name: enforcement-hook
  mountPath: /var/lib/gpushare/bin
# what the hook set, read back by the node agent
- name: enforcement-state
  mountPath: /var/run/gpushare/limits
- name: enforcement-cdi
  mountPath: /run/gpushare/limit-cdi
- name: host-cgroup
  mountPath: /host/sys/fs/cgroup
  readOnly: true
{{- end }}
{{- if include "gpushare.limiter.on" . }}
# the CUDA memory limiter and its preload list, installed here by the node agent
- name: limiter-lib
  mountPath: /var/lib/gpushare/limiter
# each container's limits file and ledgers (tmpfs on the host)
- name: limiter-run
  mountPath: /run/gpushare/limiter
{{- end }}
{{- end -}}

{{- define "gpushare.enforcement.volumes" -}}
{{- if include "gpushare.enforcement.on" . }}
- name: enforcement-hook
  hostPath:
    path: /var/lib/gpushare/bin
    type: DirectoryOrCreate
- name: enforcement-state
  hostPath:
    path: /var/run/gpushare/limits
    type: DirectoryOrCreate
- name: enforcement-cdi
  hostPath:
    path: /var/run/cdi
    type: DirectoryOrCreate
- name: host-cgroup
  hostPath:
    path: /sys/fs/cgroup
    type: Directory
{{- end }}
{{- if include "gpushare.limiter.on" . }}
- name: limiter-lib
  hostPath:
    path: /var/lib/gpushare/limiter
    type: DirectoryOrCreate
- name: limiter-run
  hostPath:
    path: /run/gpushare/limiter
    type: DirectoryOrCreate
{{- end }}
{{- end -}}
