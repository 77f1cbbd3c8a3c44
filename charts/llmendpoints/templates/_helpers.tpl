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

{{- define "llmendpoints.runtimeImage" -}}
{{- $img := .Values.runtimeDefaults.image }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
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
