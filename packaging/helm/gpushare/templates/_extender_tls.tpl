{{/*
Helpers of authenticated scheduling (extender.tls): the extender serves HTTPS and, with
clientAuth, answers filter / prioritize / bind / inspect only to a client certificate of the
chart's CA. The Secrets (kubernetes.io/tls, with ca.crt) come from templates/extender-tls.yaml.
*/}}

{{/* "https" when extender.tls.enabled, else "http". */}}
{{- define "gpushare.extender.scheme" -}}
{{- if .Values.extender.tls.enabled }}https{{ else }}http{{ end -}}
{{- end -}}

{{/* Where the extender reads its serving certificate, key and client CA. */}}
{{- define "gpushare.extender.tlsDir" -}}
/etc/gpushare/tls
{{- end -}}

{{/* Where the dedicated scheduler reads its client certificate (templates/managed/). */}}
{{- define "gpushare.scheduler.tlsDir" -}}
/etc/gpushare-scheduler-tls
{{- end -}}

{{/* The extender's TLS flags (list items, indented by the caller). */}}
{{- define "gpushare.extender.tlsArgs" -}}
{{- if .Values.extender.tls.enabled }}
- --tls-cert={{ include "gpushare.extender.tlsDir" . }}/tls.crt
- --tls-key={{ include "gpushare.extender.tlsDir" . }}/tls.key
{{- if .Values.extender.tls.clientAuth }}
- --tls-client-ca={{ include "gpushare.extender.tlsDir" . }}/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{/* The extender container's volumeMounts (the whole key, or nothing). */}}
{{- define "gpushare.extender.tlsVolumeMounts" -}}
{{- if .Values.extender.tls.enabled }}
- name: tls
  mountPath: {{ include "gpushare.extender.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The extender pod's TLS volume (a list item, or nothing). */}}
{{- define "gpushare.extender.tlsVolumes" -}}
{{- if .Values.extender.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.extender.tls.serverSecretName }}
{{- end }}
{{- end -}}

{{/* The tlsConfig of kube-scheduler's extender entry; dir: where the scheduler finds the
client Secret's files. Call with (dict "root" $ "dir" "/path"). */}}
{{- define "gpushare.scheduler.tlsConfig" -}}
{{- if .root.Values.extender.tls.enabled }}
tlsConfig:
  caFile: {{ .dir }}/ca.crt
{{- if .root.Values.extender.tls.clientAuth }}
  certFile: {{ .dir }}/tls.crt
  keyFile: {{ .dir }}/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* The names the serving certificate is valid for: the Service's, and the node's loopback
(kubeadm's kube-scheduler calls the NodePort at 127.0.0.1). */}}
{{- define "gpushare.extender.dnsNames" -}}
{{- $ns := .Release.Namespace -}}
{{- list "localhost" "gpushare-schd-extender" (printf "gpushare-schd-extender.%s" $ns) (printf "gpushare-schd-extender.%s.svc" $ns) (printf "gpushare-schd-extender.%s.svc.cluster.local" $ns) | toJson -}}
{{- end -}}
