{{/*
Helpers of the managed-cluster objects (scheduler.mode: dedicated): the dedicated
kube-scheduler and the admission webhook. Plain Helm syntax; rendered by the real Helm engine.
*/}}

{{/* Labels of one component. Call with (dict "root" $ "component" "gpushare-scheduler"). */}}
{{- define "gpushare.managed.labels" -}}
app: gpushare
component: {{ .component }}
app.kubernetes.io/name: gpushare
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* kube-scheduler image tag: the value, else the cluster's own version without the vendor
suffix (v1.30.4-eks-a737599 -> v1.30.4), the images registry.k8s.io publishes. */}}
{{- define "gpushare.scheduler.tag" -}}
{{- if .Values.scheduler.image.tag -}}
{{- .Values.scheduler.image.tag -}}
{{- else -}}
{{- regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- end -}}
{{- end -}}

{{/* The URL the dedicated scheduler calls the extender at: the extender's Service. */}}
{{- define "gpushare.scheduler.extenderURL" -}}
{{- if .Values.scheduler.extenderURL -}}
{{- .Values.scheduler.extenderURL -}}
{{- else -}}
{{- printf "%s://gpushare-schd-extender.%s.svc:%v/gpushare-scheduler" (include "gpushare.extender.scheme" .) .Release.Namespace .Values.extender.port -}}
{{- end -}}
{{- end -}}

{{/* Whether gpushare webhook is deployed ("true" or ""): the dedicated mode's router of
gpu-mem pods, and the DRA path's rewrite of gpu-mem pods into claims in either mode. */}}
{{- define "gpushare.webhook.enabled" -}}
{{- if or (eq .Values.scheduler.mode "dedicated") .Values.dra.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* The scheduler the webhook sends gpu-mem pods to: the dedicated scheduler, or none in
extender mode (the default kube-scheduler calls the extender; only the DRA path's pods are
changed). */}}
{{- define "gpushare.webhook.schedulerName" -}}
{{- if eq .Values.scheduler.mode "dedicated" -}}
{{- .Values.scheduler.name -}}
{{- end -}}
{{- end -}}

{{/* The one priority class of the managed components. */}}
{{- define "gpushare.managed.priorityClassName" -}}
{{- if .Values.priorityClass.create -}}
{{- .Values.priorityClass.name -}}
{{- else -}}
{{- .Values.priorityClass.existing -}}
{{- end -}}
{{- end -}}
