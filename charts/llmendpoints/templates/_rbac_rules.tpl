{{/*
The operator's permissions, least privilege. No wildcards: every resource and verb is named, and
each rule says why the operator needs it. Secrets are absent on purpose: the operator only
*references* Secrets (HF token via secretKeyRef, API keys as a mounted volume); the kubelet
resolves them for the runtime pod, so the operator never reads a Secret's data.
*/}}

{{/* Cluster-scoped, read-only: what kopf needs to find the LLMEndpoint resource. */}}
{{- define "llmendpoints.discoveryRules" -}}
# kopf lists and watches CRDs to discover the LLMEndpoint resource and to notice it being
# (re)installed or upgraded while the operator runs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}

{{/* Rules that apply within the watched namespaces (or all of them). */}}
{{- define "llmendpoints.namespacedRules" -}}
# The resource itself: kopf lists and watches it, and patches it to keep its own bookkeeping
# (finalizer, last-handled-configuration annotation).
- apiGroups: [llmendpoints.dev]
  resources: [llmendpoints]
  verbs: [get, list, watch, patch]
# Conditions, replicas, URL and scaling decisions are written to the status subresource.
- apiGroups: [llmendpoints.dev]
  resources: [llmendpoints/status]
  verbs: [get, patch]
# The scale subresource mirrors the replicas the autoscaler decided (kubectl scale, HPA-style tools).
- apiGroups: [llmendpoints.dev]
  resources: [llmendpoints/scale]
  verbs: [get, patch]
# Each endpoint's serving workload: created, updated to match the spec, removed when no longer wanted.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
# The autoscaler changes replicas through the Deployment's scale subresource.
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch, update]
# Services (in-cluster URL), ConfigMaps (chat templates) and PersistentVolumeClaims (the shared
# model cache) are children of an endpoint, managed the same way.
- apiGroups: [""]
  resources: [services, configmaps, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, update, delete]
# A PodDisruptionBudget exists while an endpoint has more than one replica and is removed below that.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
# An Ingress exists when spec.api.ingress.enabled is set and is removed when it is unset.
- apiGroups: [networking.k8s.io]
  resources: [ingresses]
  verbs: [get, list, watch, create, patch, update, delete]
# Status explains pod problems (pending, crash-looping, unschedulable): read-only.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# The autoscaler finds ready runtime pods and their addresses through the Service's EndpointSlices.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# Kubernetes Events on notable transitions (created, invalid spec, rolled out, scaled, degraded).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
