{{/*
Labels of the gpushare chart. Object names and the upstream labels (app, component, name)
stay literal in the templates: selectors and names are what a cluster running the Go version
already has, so they never depend on the release name.
*/}}

{{/* The chart label: name-version, as Helm's own starter chart writes it. */}}
{{- define "gpushare.chart" -}}
{{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Recommended labels of every object (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/). */}}
{{- define "gpushare.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "gpushare.chart" . }}
{{- end }}

{{/* Labels added to pod templates (never to selectors, which are immutable). */}}
{{- define "gpushare.podLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The gpushare image: repository@digest when a digest is given, else repository:tag, the
tag defaulting to the chart's appVersion. */}}
{{- define "gpushare.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* Annotations of a pod template: the global podAnnotations, the role's, and the checksum of
gpushare.toml (a config change restarts the pods). Call with (dict "root" $ "role" .Values.extender). */}}
{{- define "gpushare.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/config.yaml") .root | sha256sum }}
{{- with merge (deepCopy (.role.podAnnotations | default dict)) (.root.Values.podAnnotations | default dict) }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Where gpushare.toml is mounted in every gpushare container. */}}
{{- define "gpushare.configDir" -}}
/etc/gpushare/config
{{- end }}

{{/* Whether the device plugin reads a kernel log (devicePlugin.kmsg.enabled; a plain boolean,
the chart's earlier form, is still accepted): "true" or "". */}}
{{- define "gpushare.kmsg.enabled" -}}
{{- $k := .Values.devicePlugin.kmsg -}}
{{- if kindIs "map" $k -}}
{{- if $k.enabled }}true{{ end -}}
{{- else if $k -}}
true
{{- end -}}
{{- end }}

{{/* The host kernel log the device plugin reads (default /dev/kmsg). */}}
{{- define "gpushare.kmsg.path" -}}
{{- $k := .Values.devicePlugin.kmsg -}}
{{- if and (kindIs "map" $k) $k.hostPath -}}
{{ $k.hostPath }}
{{- else -}}
/dev/kmsg
{{- end -}}
{{- end }}

{{/* Whether the ValidatingAdmissionPolicy of the device plugin is rendered: "true" or "". */}}
{{- define "gpushare.admissionPolicy.enabled" -}}
{{- $v := toString .Values.devicePlugin.admissionPolicy.enabled -}}
{{- if eq $v "true" -}}
true
{{- else if and (eq $v "auto") (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") -}}
true
{{- end -}}
{{- end }}

{{/*
The extended resources of the device kinds beside the GPU that `config.devices` enables (the
RDMA HCAs' resource when `config.devices.rdma.enabled`, then each `config.devices.generic`
entry's), one per line; empty when none.
*/}}
{{- define "gpushare.devices.resources" -}}
{{- $devices := .Values.config.devices | default dict -}}
{{- $rdma := $devices.rdma | default dict -}}
{{- if $rdma.enabled }}
{{ $rdma.resource | default "gpushare.io/rdma" }}
{{- end }}
{{- range ($devices.generic | default list) }}
{{ .resource }}
{{- end }}
{{- end }}

{{/*
The host's /dev for a node role serving device kinds: the env that points `devices.dev_root`
at it (unless config.devices.dev_root is set), its mount and its volume. Each takes the root
context and renders nothing when no kind is enabled.
*/}}
{{- define "gpushare.devices.env" -}}
{{- $devices := .Values.config.devices | default dict -}}
{{- if and (trim (include "gpushare.devices.resources" .)) (not $devices.dev_root) }}
- name: GPUSHARE_DEVICES__DEV_ROOT
  value: /host/dev
{{- end }}
{{- end }}

{{/* The GPU lock files both node roles take before offering a GPU (one path per GPU across
the device plugin and the DRA plugin): the same host directory in both DaemonSets. */}}
{{- define "gpushare.gpuLocks.volumeMount" -}}
- name: gpu-locks
  mountPath: /var/run/gpushare/gpus
{{- end }}

{{- define "gpushare.gpuLocks.volume" -}}
- name: gpu-locks
  hostPath:
    path: /var/run/gpushare/gpus
    type: DirectoryOrCreate
{{- end }}

{{- define "gpushare.devices.volumeMount" -}}
{{- if trim (include "gpushare.devices.resources" .) }}
# the host's /dev: /dev/infiniband and the generic devices' nodes (read, never opened)
- name: host-dev
  mountPath: /host/dev
  readOnly: true
{{- end }}
{{- end }}

{{- define "gpushare.devices.volume" -}}
{{- if trim (include "gpushare.devices.resources" .) }}
- name: host-dev
  hostPath:
    path: /dev
    type: Directory
{{- end }}
{{- end }}
