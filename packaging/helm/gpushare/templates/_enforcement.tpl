{{/*
GPU memory enforcement (devicePlugin.enforcement, docs/enforcement.md) on both node roles.
With auto or driver: the node agent installs itself as the CDI hook at
/var/lib/gpushare/bin/gpushare (a host directory, the same path on both sides), records the
limits the hook sets in /var/run/gpushare/limits, reads the host's cgroup tree at
/host/sys/fs/cgroup, and (device-plugin path) writes the specs carrying the hook into the
host's /var/run/cdi, mounted at /run/gpushare/limit-cdi. With mps or none: only the flag.
*/}}
{{- define "gpushare.enforcement.on" -}}
{{- if has .Values.devicePlugin.enforcement (list "auto" "driver") }}true{{ end -}}
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
{{- end -}}
