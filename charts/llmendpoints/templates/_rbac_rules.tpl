{{/*
The operator's permissions, least privilege. No wildcards: every resource and verb is named, and
each rule says why the operator needs it. Secrets: create only. The operator *references* the
user's Secrets (HF token via secretKeyRef, API keys as a mounted volume) and the kubelet resolves
them for the runtime pod; the one Secret it writes is each endpoint's generated admin key, created
once. It never lists, watches, updates or deletes a Secret, and reads one only when you turn on
fit.readTokenSecrets (the fit check then reads the hub token an endpoint names).
*/}}

{{/* Cluster-scoped, read-only: what kopf needs to find the LLMEndpoint resource. */}}
{{- define "llmendpoints.discoveryRules" -}}
# kopf lists and watches CRDs to discover the LLMEndpoint resource and to notice it being
# (re)installed or upgraded while the operator runs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.fit.enabled }}
# The fit check reads the GPU feature discovery labels (nvidia.com/gpu.memory, .product, .count)
# and taints of the nodes an endpoint's pods may run on. Read-only.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- end }}
{{- end }}

{{/*
Rules that apply within the watched namespaces (or all of them). Children are written with
server-side apply, which the API server authorizes as `patch`, and as `create` too when the object
does not exist yet. tests/chart checks these rules against what the operator's code watches and
writes, so a new child kind or watch cannot ship without its permission.
*/}}
{{- define "llmendpoints.namespacedRules" -}}
# The resource itself: kopf lists and watches it (handlers and an in-memory index) and patches it
# for its own bookkeeping (finalizer, last-handled-configuration annotation). Never a single GET.
- apiGroups: [llmendpoints.dev]
  resources: [llmendpoints]
  verbs: [list, watch, patch]
# Conditions, phase, replicas, URL and the autoscaler's decisions are written to status.
- apiGroups: [llmendpoints.dev]
  resources: [llmendpoints/status]
  verbs: [patch]
# Each endpoint's serving workload: watched (its rollout feeds the status), created, kept in line
# with the spec by server-side apply; replica changes (autoscaler, bounds, pins) are merge patches.
# Deleted by the operator only when spec.resources.nodes turns the endpoint into LeaderWorkerSet
# groups (or back); otherwise garbage collection removes it with its LLMEndpoint (owner reference).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
# A multi-node endpoint's workload (spec.resources.nodes > 1): one LeaderWorkerSet of groups, the
# same verbs as a Deployment (its replicas, the groups, are merge patches of the object itself,
# not of its scale subresource). Harmless where LeaderWorkerSet is not installed (the operator
# then says so in the endpoint's status).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [list, watch, create, patch, delete]
# A multi-node endpoint's pods, listed while one of its groups is not ready: the status names the
# pod (and node) that keeps it from being ready.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# The shared model cache: watched (its binding feeds the status's CacheReady condition), created
# and deleted when spec.cache no longer asks for a claim the operator created.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [list, watch, create, patch, delete]
# The endpoint's Service (its stable in-cluster URL): created and kept in line with the spec.
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch]
# Optional children, deleted when the spec stops asking for them: the chat-template ConfigMap,
# the PodDisruptionBudget (more than one replica) and the Ingress (spec.api.ingress.enabled).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses]
  verbs: [create, patch, delete]
# InferencePools (Gateway API Inference Extension) for endpoints that ask for one
# (spec.api.inferencePool): created, kept in line with the spec, deleted when the spec stops
# asking. Harmless where the CRD is not installed (the operator then reports it in the status).
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [create, patch, delete]
# The autoscaler finds the ready runtime pods and their addresses in the Service's EndpointSlices.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list]
# Each endpoint's admin key (<endpoint>-admin-key), generated and created once, then mounted by
# its pods; an existing one is known by the API's 409, never read.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- if and .Values.fit.enabled .Values.fit.readTokenSecrets }}
# fit.readTokenSecrets: the fit check reads the hub token of spec.model.hfTokenSecretRef to check
# private and gated models. Any Secret of the namespace by name (RBAC cannot narrow it to the ones
# endpoints name); never listed or watched.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# Kubernetes Events on notable transitions (created, invalid spec, rolled out, scaled, degraded).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
