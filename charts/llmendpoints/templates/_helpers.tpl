{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "llmendpoints.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources. */}}
{{- define "llmendpoints.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "llmendpoints.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llmendpoints.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llmendpoints
{{- end }}

{{/* Labels that select the operator pod (immutable once installed). */}}
{{- define "llmendpoints.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmendpoints.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "llmendpoints.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llmendpoints.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: the digest wins over the tag; the tag defaults to appVersion. */}}
{{- define "llmendpoints.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The runtime image endpoints get by default: the digest wins over the tag, as above. */}}
{{- define "llmendpoints.runtimeImage" -}}
{{- $img := .Values.runtimeDefaults.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* True ("true") when the operator watches every namespace. */}}
{{- define "llmendpoints.clusterwide" -}}
{{- if empty .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
Labels the operator puts on every runtime pod (operator/llmendpoints_operator/manifests.py);
the PodMonitor selects pods by them.
*/}}
{{- define "llmendpoints.runtimePodSelector" -}}
app.kubernetes.io/managed-by: llmendpoints-operator
{{- end }}

{{/* The runtime pod label naming its LLMEndpoint, as a Prometheus service-discovery label. */}}
{{- define "llmendpoints.runtimeEndpointLabel" -}}
{{- printf "__meta_kubernetes_pod_label_%s" (regexReplaceAll "[^a-zA-Z0-9_]" "llmendpoints.dev/endpoint" "_") }}
{{- end }}

{{/*
The cluster-admin policy (values `policy:`) as the operator's LLMEP_OPERATOR_* settings. A list
left null is no restriction (no variable); [] is the empty variable (nothing allowed).
*/}}
{{- define "llmendpoints.policyLists" -}}
allowedImages: ALLOWED_IMAGES
allowedServiceTypes: ALLOWED_SERVICE_TYPES
allowedPriorityClasses: ALLOWED_PRIORITY_CLASSES
allowedIngressAnnotations: ALLOWED_INGRESS_ANNOTATIONS
allowedExistingClaims: ALLOWED_EXISTING_CLAIMS
{{- end }}

{{- define "llmendpoints.policyEnv" -}}
{{- $policy := .Values.policy }}
{{- range $key, $setting := include "llmendpoints.policyLists" . | fromYaml }}
{{- $list := get $policy $key }}
{{- if not (kindIs "invalid" $list) }}
- name: LLMEP_OPERATOR_{{ $setting }}
  value: {{ join "," $list | quote }}
{{- end }}
{{- end }}
- name: LLMEP_OPERATOR_ALLOW_ENV_VALUE_FROM
  value: {{ $policy.allowEnvValueFrom | quote }}
- name: LLMEP_OPERATOR_ALLOW_TRUST_REMOTE_CODE
  value: {{ $policy.allowTrustRemoteCode | quote }}
{{- end }}

{{/*
A list of globs as a CEL list of anchored regular expressions (a JSON array is a CEL list literal):
`*` -> `.*`, `?` -> `.`, everything else literal, as policy.glob_regex does for the operator.
*/}}
{{- define "llmendpoints.globRegexes" -}}
{{- $out := list }}
{{- range . }}
{{- $out = append $out (printf "^%s$" (regexQuoteMeta . | replace "\\*" ".*" | replace "\\?" ".")) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* True ("true") when the policy restricts anything, i.e. when there is something to enforce. */}}
{{- define "llmendpoints.policyRestricts" -}}
{{- $p := .Values.policy }}
{{- $lists := include "llmendpoints.policyLists" . | fromYaml }}
{{- $restricts := or (not $p.allowEnvValueFrom) (not $p.allowTrustRemoteCode) }}
{{- range $key, $_ := $lists }}
{{- if not (kindIs "invalid" (get $p $key)) }}{{ $restricts = true }}{{ end }}
{{- end }}
{{- if $restricts }}true{{ end }}
{{- end }}

{{/* The gateway: names, labels and image. */}}
{{- define "llmendpoints.gateway.fullname" -}}
{{- printf "%s-gateway" (include "llmendpoints.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmendpoints.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmendpoints.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "llmendpoints.gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llmendpoints.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llmendpoints
{{- end }}

{{- define "llmendpoints.gateway.image" -}}
{{- $img := .Values.gateway.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* The one URL for every model: the gateway's in-cluster Service. */}}
{{- define "llmendpoints.gateway.url" -}}
{{- $port := int .Values.gateway.service.port }}
{{- printf "http://%s.%s.svc%s" (include "llmendpoints.gateway.fullname" .) .Release.Namespace (ternary "" (printf ":%d" $port) (eq $port 80)) }}
{{- end }}

{{/* The job queue's NATS servers (queue.enabled). */}}
{{- define "llmendpoints.nats.fullname" -}}
{{- printf "%s-nats" (include "llmendpoints.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmendpoints.nats.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmendpoints.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: job-queue
{{- end }}

{{- define "llmendpoints.nats.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llmendpoints.nats.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.queue.nats.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llmendpoints
{{- end }}

{{- define "llmendpoints.nats.image" -}}
{{- $img := .Values.queue.nats.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository $img.tag }}
{{- end }}
{{- end }}

{{/*
The shared job queue's URL as one env entry named `name` (value or secretKeyRef), or nothing:
the chart's own NATS (queue.enabled), an existing Secret, or a plain queue.url. The operator
and the gateway read the same queue. Call with (dict "root" $ "name" "JOBS_QUEUE_URL").
*/}}
{{- define "llmendpoints.queueUrlEnv" -}}
{{- $v := .root.Values.queue }}
{{- if $v.enabled }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "llmendpoints.nats.fullname" .root }}
      key: url
{{- else if $v.existingSecret }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.existingSecret }}
      key: {{ $v.existingSecretKey }}
{{- else if $v.url }}
{{- if regexMatch "^[a-z]+://[^/]*@" $v.url }}
{{- fail "queue.url carries credentials: secrets go by reference -- put the URL in a Secret and set queue.existingSecret" }}
{{- end }}
- name: {{ .name }}
  value: {{ $v.url | quote }}
{{- end }}
{{- end }}

{{/* Whether the release has a shared job queue ("true" or nothing). */}}
{{- define "llmendpoints.hasQueue" -}}
{{- if or .Values.queue.enabled .Values.queue.existingSecret .Values.queue.url }}true{{ end }}
{{- end }}
