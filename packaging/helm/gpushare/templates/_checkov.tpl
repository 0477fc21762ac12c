{{/*
checkov's own skips, next to the objects they are about: annotations
`checkov.io/skipN: CHECK=reason` (https://www.checkov.io/2.Basics/Suppressing%20and%20Skipping%20Policies.html),
so that a plain `checkov -d .` over the rendered chart (and over packaging/manifests/, rendered
from it) reports nothing unexplained. The reasons, by check: */}}
{{- define "gpushare.checkov.reasons" -}}
CKV_K8S_11: "CPU requests are set; a CPU limit would throttle (CFS quota) the extender's filter and bind, the webhook and the device plugin's Allocate, which sit on the path of every GPU pod's scheduling and start. Memory limits are set; add CPU limits through the resources values."
CKV_K8S_43: "A chart cannot know the digest of an image built after it: image.digest (scheduler.image.digest) pulls by digest."
CKV_K8S_15: "IfNotPresent with release tags that are never reused: Always would make every restart depend on the registry, on every GPU node. Set pullPolicy Always where tags are mutable, or pull by digest."
CKV_K8S_38: "Every role talks to the API server (watches, bindings, annotations, Leases, Events, its own webhook configuration): the token is needed. Each ServiceAccount has only the RBAC it uses."
CKV_K8S_23: "The device plugin creates its socket in kubelet's root-owned device-plugin directory and dials kubelet.sock (srwxr-xr-x root), which needs uid 0; it runs with every capability dropped, no privilege escalation and a read-only root."
CKV_K8S_40: "The device plugin runs as root (uid 0), see CKV_K8S_23."
CKV2_K8S_6: "The device plugin serves only its unix socket and its admin port; the dedicated scheduler and the webhook are called by the API server, whose address a NetworkPolicy cannot name portably; the extender's NetworkPolicy is extender.networkPolicy, with client certificates (extender.tls)."
CKV_K8S_16: "Privileged only with devicePlugin.kmsg on the host's /dev/kmsg (the device cgroup opens it to privileged containers only) or devicePlugin.mps (the MPS daemon starts each server as its client's user); both off by default."
CKV_K8S_20: "Kubernetes refuses allowPrivilegeEscalation false on a privileged container, see CKV_K8S_16."
CKV_K8S_28: "A privileged container has every capability, see CKV_K8S_16."
CKV_K8S_37: "A privileged container has every capability, see CKV_K8S_16."
CKV_K8S_19: "Only with hostNetwork set (off by default): upstream ran on the host network, and a cluster whose scheduler reaches the extender at the node's own address may keep it."
CKV_K8S_155: "gpushare webhook --self-signed writes its CA into the caBundle of its own two webhook configurations: get and patch, limited by resourceNames to gpushare-webhook."
CKV_K8S_114: "The dedicated scheduler runs with --config, next to which --profiling is ignored; its KubeSchedulerConfiguration sets enableProfiling: false."
CKV_K8S_115: "The dedicated scheduler is a pod: kubelet probes /healthz on the pod's address, which a loopback-only listener would refuse; the secure port authenticates and authorizes every request but /healthz, /readyz and /livez."
{{- end }}

{{/* The annotations block of an object: (dict "checks" LIST "digest" DIGEST "hostNetwork" BOOL
"privileged" BOOL); the image checks are added without a digest, the host-network and
privileged ones only where they apply. */}}
{{- define "gpushare.checkov.annotations" -}}
{{- $reasons := include "gpushare.checkov.reasons" . | fromYaml -}}
{{- $checks := .checks -}}
{{- if and (hasKey . "digest") (not .digest) }}{{ $checks = concat $checks (list "CKV_K8S_43" "CKV_K8S_15") }}{{ end -}}
{{- if .hostNetwork }}{{ $checks = append $checks "CKV_K8S_19" }}{{ end -}}
{{- if .privileged }}{{ $checks = concat $checks (list "CKV_K8S_16" "CKV_K8S_20" "CKV_K8S_28" "CKV_K8S_37") }}{{ end -}}
annotations:
{{- range $i, $c := $checks }}
  checkov.io/skip{{ add1 $i }}: {{ printf "%s=%s" $c (required (printf "no reason for %s" $c) (get $reasons $c)) | quote }}
{{- end }}
{{- end }}
