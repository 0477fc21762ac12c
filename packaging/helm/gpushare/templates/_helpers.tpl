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
