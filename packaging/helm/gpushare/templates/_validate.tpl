{{/*
Combinations of values that each pass the schema (values.schema.json) but cannot work
together: refused at render time with the reason. Included once, from config.yaml (rendered
in every mode).
*/}}
{{- define "gpushare.validate" -}}
{{- $e := .Values.extender -}}
{{- $dp := .Values.devicePlugin -}}
{{- if and $e.networkPolicy.enabled (eq .Values.scheduler.mode "extender") (not $e.networkPolicy.schedulerCIDRs) -}}
{{- fail "extender.networkPolicy.enabled with scheduler.mode=extender needs extender.networkPolicy.schedulerCIDRs: kube-scheduler runs on the control-plane nodes' host network and comes in through the NodePort, so without those nodes' addresses the NetworkPolicy would block every call of the scheduler (list them, e.g. [10.0.0.0/24])" -}}
{{- end -}}
{{- if and (gt (int $e.replicas) 1) (not $e.leaderElect) -}}
{{- fail (printf "extender.replicas=%d needs extender.leaderElect=true: replicas without a leader each keep their own account of the GPUs and would bind two pods to the same memory (set replicas: 1, or keep leaderElect)" (int $e.replicas)) -}}
{{- end -}}
{{- if and (eq $dp.gpuBackend "fake") (not $dp.fakeGpus) -}}
{{- fail "devicePlugin.gpuBackend=fake needs devicePlugin.fakeGpus (e.g. 2x16GiB): the device plugin would have no GPU to offer" -}}
{{- end -}}
{{- if and $dp.fakeGpus (ne $dp.gpuBackend "fake") -}}
{{- fail (printf "devicePlugin.fakeGpus is read only with devicePlugin.gpuBackend=fake (it is %s): set gpuBackend: fake, or drop fakeGpus" $dp.gpuBackend) -}}
{{- end -}}
{{- if and (include "gpushare.webhook.enabled" .) .Values.webhook.tls.existingSecret (not .Values.webhook.tls.injectCaFrom) -}}
{{- fail "webhook.tls.existingSecret needs webhook.tls.injectCaFrom (<namespace>/<certificate>): with a Secret of your own nobody else writes the webhook configurations' caBundle, and the API server could not call the webhook" -}}
{{- end -}}
{{- if and .Values.dra.enabled (not .Values.dra.nodeSelector) -}}
{{- fail "dra.enabled needs dra.nodeSelector (default gpushare.io/gpu-mem-path: dra): without it the DRA plugin would run on every node, beside the device plugin on the same GPUs (label the DRA nodes and select them)" -}}
{{- end -}}
{{- if and (eq .Values.webhook.gpuMemPath "dra") (not .Values.dra.enabled) -}}
{{- fail "webhook.gpuMemPath=dra needs dra.enabled=true: the pods would be rewritten into claims of a DeviceClass and a driver that are not installed" -}}
{{- end -}}
{{- end }}
