{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "trainpatrol.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: <release>-<chart>, or the release name when it already holds the chart name. */}}
{{- define "trainpatrol.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<suffix>, still a valid DNS label. Call with (list . "suffix"). */}}
{{- define "trainpatrol.componentName" -}}
{{- $ctx := index . 0 -}}
{{- printf "%s-%s" (include "trainpatrol.fullname" $ctx | trunc (int (sub 62 (len (index . 1))))) (index . 1) | trimSuffix "-" -}}
{{- end -}}

{{- define "trainpatrol.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels. Call with (dict "ctx" . "component" "agent"); component may be empty. */}}
{{- define "trainpatrol.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainpatrol.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{/* Standard labels. Call with (dict "ctx" . "component" "agent"). */}}
{{- define "trainpatrol.labels" -}}
helm.sh/chart: {{ include "trainpatrol.chart" .ctx }}
{{ include "trainpatrol.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: trainpatrol
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Namespace of every object: namespaceOverride (e.g. from an umbrella chart), else the release's. */}}
{{- define "trainpatrol.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <registry>/<repository>, global.imageRegistry winning as umbrella charts expect; no registry: the repository alone. */}}
{{- define "trainpatrol.image" -}}
{{- $registry := .Values.image.registry -}}
{{- with .Values.global }}{{ with .imageRegistry }}{{ $registry = . }}{{ end }}{{ end -}}
{{- $repository := ternary (printf "%s/%s" $registry .Values.image.repository) .Values.image.repository (ne $registry "") -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Codes of XIDs that page critical in the generated rules (alerting/config.py xid_critical_codes). */}}
{{- define "trainpatrol.shippedXidCodes" -}}
48,62,64,74,79,95,119,120
{{- end -}}

{{- define "trainpatrol.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "trainpatrol.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The token Secret: the user's, or the one this chart creates. */}}
{{- define "trainpatrol.tokenSecretName" -}}
{{- default (include "trainpatrol.componentName" (list . "token")) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "trainpatrol.tokenSecretKey" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecretKey -}}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/*
The base64 token of the generated Secret, in order of precedence: the value given (auth.token),
the one already stored in the cluster (so upgrades keep it and running jobs keep working), or a
new random one. Call with (dict "given" .Values.auth.token "existing" (lookup ...)); kept apart
from the lookup so the precedence can be tested without a cluster.
*/}}
{{- define "trainpatrol.tokenData" -}}
{{- $existing := .existing | default dict -}}
{{- $data := get $existing "data" | default dict -}}
{{- if .given -}}
{{- .given | b64enc -}}
{{- else if get $data "token" -}}
{{- get $data "token" -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{- define "trainpatrol.agentName" -}}
{{- include "trainpatrol.componentName" (list . "agent") -}}
{{- end -}}

{{- define "trainpatrol.routerName" -}}
{{- include "trainpatrol.componentName" (list . "router") -}}
{{- end -}}

{{/* The agents' headless Service; its DNS name resolves to every agent pod (the peers). */}}
{{- define "trainpatrol.peersService" -}}
{{- include "trainpatrol.componentName" (list . "agent-peers") -}}
{{- end -}}

{{/* The node-local Service training pods push through: only to the agent on their own node. */}}
{{- define "trainpatrol.localService" -}}
{{- include "trainpatrol.componentName" (list . "agent") -}}
{{- end -}}

{{- define "trainpatrol.localDNS" -}}
{{- printf "%s.%s.svc.%s" (include "trainpatrol.localService" .) (include "trainpatrol.namespace" .) .Values.clusterDomain -}}
{{- end -}}

{{- define "trainpatrol.peersDNS" -}}
{{- printf "%s.%s.svc.%s" (include "trainpatrol.peersService" .) (include "trainpatrol.namespace" .) .Values.clusterDomain -}}
{{- end -}}

{{- define "trainpatrol.webhookURL" -}}
{{- printf "http://%s.%s.svc.%s:%d/v1/alertmanager" (include "trainpatrol.routerName" .) (include "trainpatrol.namespace" .) .Values.clusterDomain (int .Values.port) -}}
{{- end -}}

{{/* Flags and environment shared by agent and router. */}}
{{- define "trainpatrol.commonArgs" -}}
- {{ printf "--host=%s" .Values.listenAddress | quote }}
- {{ printf "--port=%d" (int .Values.port) | quote }}
- "--token-file=/etc/trainpatrol/token/token"
- {{ printf "--peers-dns=%s" (include "trainpatrol.peersDNS" .) | quote }}
- {{ printf "--allowed-actions=%s" (join "," .Values.allowedActions) | quote }}
- {{ printf "--log-level=%s" .Values.logLevel | quote }}
{{- end -}}

{{- define "trainpatrol.volumes" -}}
- name: token
  secret:
    secretName: {{ include "trainpatrol.tokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ include "trainpatrol.tokenSecretKey" . }}
        path: token
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}

{{- define "trainpatrol.volumeMounts" -}}
- name: token
  mountPath: /etc/trainpatrol/token
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* --allowed-hosts: the Host names a pod answers to (agent.edge refuses others with 421). The pod IP,
   which Prometheus, kubelet probes and peers (through the headless Service) use; the Service's names in
   every form a client may write; extra.hostIP adds the node IP that ranks reach a hostPort on; then
   .Values.allowedHosts. Call with (list . "<service name>" <with node IP>). */}}
{{- define "trainpatrol.allowedHostsArg" -}}
{{- $ctx := index . 0 -}}
{{- $ns := include "trainpatrol.namespace" $ctx -}}
{{- $hosts := list "$(POD_IP)" -}}
{{- range $svc := index . 1 -}}
{{- $hosts = concat $hosts (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns $ctx.Values.clusterDomain)) -}}
{{- end -}}
{{- if index . 2 -}}{{- $hosts = append $hosts "$(NODE_IP)" -}}{{- end -}}
{{- $hosts = concat $hosts $ctx.Values.allowedHosts -}}
- {{ printf "--allowed-hosts=%s" (join "," $hosts) | quote }}
{{- end -}}

{{/* Settings that cannot work together fail the render with a message naming the values. */}}
{{- define "trainpatrol.validate" -}}
{{- if and .Values.serviceMonitor.enabled .Values.podMonitor.enabled -}}
{{- fail "serviceMonitor.enabled and podMonitor.enabled are both true: every agent would be scraped twice. Enable one." -}}
{{- end -}}
{{- if and .Values.alertmanagerConfig.enabled (not .Values.router.enabled) -}}
{{- fail "alertmanagerConfig.enabled needs router.enabled: the router is the webhook target." -}}
{{- end -}}
{{- if and .Values.auth.existingSecret .Values.auth.token -}}
{{- fail "auth.token and auth.existingSecret are both set: give the token one way." -}}
{{- end -}}
{{- end -}}
