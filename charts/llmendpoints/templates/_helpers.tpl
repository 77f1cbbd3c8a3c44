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

{{/* The namespace of the gateway's tenant key Secrets: never the release's, where the NATS
signing keys and the gateway token secret live (the gateway lists and watches every Secret of
its key namespace: RBAC cannot narrow a list to a label). Default: "<release namespace>-keys". */}}
{{- define "llmendpoints.gateway.keysNamespace" -}}
{{- $ns := .Values.gateway.keySecretsNamespace | default (printf "%s-keys" .Release.Namespace | trunc 63 | trimSuffix "-") }}
{{- if eq $ns .Release.Namespace }}
{{- fail (printf "gateway.keySecretsNamespace: %q is the release namespace; the gateway lists and watches every Secret of its key namespace (RBAC cannot narrow that to a label), and the NATS signing keys and the gateway token secret live in the release namespace. Give the key Secrets a namespace of their own (the default: %s-keys; docs/install.md, \"Upgrade\", moves existing keys)" $ns .Release.Namespace) }}
{{- end }}
{{- $ns }}
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
The Secret holding the shared job queue's keys (per-role NATS credentials; files operator,
system-account, account, account-signing, cluster-password), or nothing: queue.auth.existingSecret,
else the one the chart generates for its own NATS (queue.enabled). With keys, no password is in
any URL: every role connects with its own creds file (docs/security.md).
*/}}
{{- define "llmendpoints.queue.keysSecret" -}}
{{- if .Values.queue.auth.existingSecret }}{{ .Values.queue.auth.existingSecret }}
{{- else if .Values.queue.enabled }}{{ include "llmendpoints.nats.fullname" . }}-keys
{{- end }}
{{- end }}

{{/* The chart's NATS URL (no credentials in it). */}}
{{- define "llmendpoints.nats.url" -}}
{{- printf "nats://%s.%s.svc:4222" (include "llmendpoints.nats.fullname" .) .Release.Namespace }}
{{- end }}

{{/*
The shared job queue's URL as one env entry named `name` (value or secretKeyRef), or nothing:
the chart's own NATS (queue.enabled: a plain URL, credentials are creds files), an existing
Secret, or a plain queue.url. The operator and the gateway read the same queue. Call with
(dict "root" $ "name" "JOBS_QUEUE_URL").
*/}}
{{- define "llmendpoints.queueUrlEnv" -}}
{{- $v := .root.Values.queue }}
{{- if $v.enabled }}
- name: {{ .name }}
  value: {{ include "llmendpoints.nats.url" .root | quote }}
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

{{/*
An init container that mints a role's creds file into the volume `queue-creds` (mounted at
/etc/llmendpoints/queue) from the keys Secret's `account` and `account-signing` (volume
`queue-keys`, mounted in this container only): the pod's main container gets its own
credential and never the key that signs credentials. Runs the operator image (it carries
`llmendpoints-operator queue-auth`). Call with (dict "root" $ "role" "gateway" "securityContext" ...).
*/}}
{{- define "llmendpoints.queue.credsInitContainer" -}}
- name: queue-creds
  image: {{ include "llmendpoints.image" .root | quote }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["llmendpoints-operator", "queue-auth", "creds", "--keys-dir", "/etc/llmendpoints/queue-keys", "--role", {{ .role | quote }}, "--out", "/etc/llmendpoints/queue/queue.creds"]
  resources:
    requests:
      cpu: 10m
      memory: 32Mi
    limits:
      cpu: 200m
      memory: 128Mi
  securityContext:
    {{- toYaml .securityContext | nindent 4 }}
  volumeMounts:
    - name: queue-keys
      mountPath: /etc/llmendpoints/queue-keys
      readOnly: true
    - name: queue-creds
      mountPath: /etc/llmendpoints/queue
{{- end }}

{{/* The keys Secret's signing half, for queue-creds init containers and the operator. */}}
{{- define "llmendpoints.queue.signingKeysVolume" -}}
- name: queue-keys
  secret:
    secretName: {{ include "llmendpoints.queue.keysSecret" . }}
    items:
      - key: account
        path: account
      - key: account-signing
        path: account-signing
{{- end }}

{{/* Whether the release has a shared job queue ("true" or nothing). */}}
{{- define "llmendpoints.hasQueue" -}}
{{- if or .Values.queue.enabled .Values.queue.existingSecret .Values.queue.url }}true{{ end }}
{{- end }}

{{/* The Secret holding the gateway token secret (the gateway's and the operator's). */}}
{{- define "llmendpoints.gateway.tokenSecret" -}}
{{- .Values.gateway.tokenSecret.existingSecret | default (printf "%s-token" (include "llmendpoints.gateway.fullname" .)) }}
{{- end }}
