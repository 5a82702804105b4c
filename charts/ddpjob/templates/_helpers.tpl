{{/* The chart's name. */}}
{{- define "ddpjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: the release name, prefixed with the chart name unless it contains it. */}}
{{- define "ddpjob.fullname" -}}
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

{{- define "ddpjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddpjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "ddpjob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ddpjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddpjob
{{- end }}

{{- define "ddpjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddpjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: the existing ServiceAccount to use (serviceAccount.create is false)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ddpjob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The namespaces served when not cluster-wide, as a JSON list: watchNamespaces, else the release namespace. */}}
{{- define "ddpjob.watchNamespaces" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces }}
{{- fail "watchNamespaces: must be empty when clusterWide is true (a cluster-wide operator serves every namespace)" }}
{{- end }}
{{- if .Values.watchNamespaces }}
{{- .Values.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "ddpjob.peering" -}}
{{- gt (int .Values.replicaCount) 1 }}
{{- end }}

{{- define "ddpjob.peeringName" -}}
{{- default (include "ddpjob.fullname" .) .Values.peering.name }}
{{- end }}

{{/*
The operator's permissions, for a Role (namespaced) or a ClusterRole (clusterWide). Every rule is
derived from the code: operator/ddpjob_operator/kube.py (the operator's own API calls) and the
kopf handlers in operator/ddpjob_operator/handlers.py (watches, finalizer patches, events).
tests/unit/test_chart.py checks this list against the code. Nothing else is needed: kopf's
namespace and CRD scanning is disabled (settings.scanning.disabled), and API discovery
(the CRD check at start-up) is open to every authenticated user.
*/}}
{{- define "ddpjob.rbacRules" -}}
# DDPJobs: kopf lists and watches them (handlers, index, daemon) and patches its finalizer
# (ddpjob.io/operator) and annotations onto them; the operator reads one again before acting
# (get) and deletes a finished job once ttlSecondsAfterFinished has passed (delete).
- apiGroups: ["ddpjob.io"]
  resources: ["ddpjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
# DDPJob status: the operator writes .status whole (merge patch, resourceVersion precondition).
- apiGroups: ["ddpjob.io"]
  resources: ["ddpjobs/status"]
  verbs: ["patch"]
# DDPJob finalizers: the owner references of the pods, Services, Secrets and NetworkPolicies
# set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement admission plugin
# (OpenShift, hardened clusters) allows only to who may update the owner's finalizers. (Creating
# an object with owner references needs no more: the plugin asks for delete only on updates.)
- apiGroups: ["ddpjob.io"]
  resources: ["ddpjobs/finalizers"]
  verbs: ["update"]
# Pods: kopf lists and watches the jobs' pods (label ddpjob.io/job-name); the operator creates
# and deletes them, lists them when a job is deleted, removes its pod-tracking finalizer (patch)
# and reads a pod again when that patch conflicts (get).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# Services: kopf lists and watches the jobs' headless Services; the operator creates them, and
# reads one that already exists to check it is the job's (get).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create"]
# Secrets: each job's store key (<job>-store-key), which its pods' agents sign the rendezvous
# store's contents with; the operator creates it before the job's pods, and reads one that
# already exists to check it is the job's (get). It never lists, watches or updates Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Events: the operator's Events on jobs (kopf.event) and kopf's own warnings (core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# NetworkPolicies: one per job that asks for it (spec.networkPolicy, or networkPolicy.enabled for
# every job), guarding its rendezvous and collective ports; get as for Services.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
# PodGroups: one per job with spec.gangScheduling: Native (Kubernetes 1.37+, GenericWorkload),
# created before its pods; get as for Services; patch sets its minCount when a suspended job's
# minReplicas changed.
- apiGroups: ["scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- if .Values.kueue.enabled }}
# Kueue Workloads (kueue.enabled): one per job that names a queue (label kueue.x-k8s.io/queue-name)
# and one more for each scale up (a workload slice). The operator lists a job's Workloads by
# Kueue's job-uid label, creates them, reads one that already exists to check it is the job's
# (get), patches the spec (the count after a scale, active after a suspend) and removes Kueue's
# resource-in-use finalizer once a Workload is finished (patch).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "create", "patch"]
# Workload status: Finished when the job ends, and the reservation given back after an eviction,
# as Kueue's own job framework writes them.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- if eq (include "ddpjob.peering" .) "true" }}
# kopf peering (replicaCount > 1): each replica lists and watches the peering objects and writes
# its keep-alive into its own (merge patch of .status; the CRD has no status subresource). kopf
# never reads one object by name, so no get.
- apiGroups: ["kopf.dev"]
  resources: [{{ if .Values.clusterWide }}"clusterkopfpeerings"{{ else }}"kopfpeerings"{{ end }}]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}

{{- /*
The cluster-scoped objects a Kueue job's Workload needs read (kueue.enabled): the admitted
ResourceFlavors (node labels and tolerations for the pods) and the job's priority class (Kueue
reads a Workload's priority, it does not compute it for an external kind).
*/ -}}
{{- define "ddpjob.kueueReaderRules" -}}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}
