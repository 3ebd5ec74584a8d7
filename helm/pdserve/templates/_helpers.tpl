{{/* Names */}}
{{- define "pdserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The RayCluster, its head service (KubeRay names it <cluster>-head-svc), Redis */}}
{{- define "pdserve.rayCluster" -}}{{ include "pdserve.fullname" . }}{{- end -}}
{{- define "pdserve.headService" -}}{{ include "pdserve.rayCluster" . }}-head-svc{{- end -}}
{{- define "pdserve.redisName" -}}{{ include "pdserve.fullname" . }}-redis{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Secrets: the chart's own unless an existing one is named */}}
{{- define "pdserve.redisSecret" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "pdserve.fullname" .)) -}}
{{- end -}}
{{- define "pdserve.raySecret" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-token" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Redis host:port (GCS fault tolerance) and the URL pdserve gets, password by reference */}}
{{- define "pdserve.redisAddress" -}}
{{- if .Values.redis.enabled -}}
{{ include "pdserve.redisName" . }}:{{ .Values.redis.port }}
{{- else -}}
{{- regexReplaceAll "^rediss?://([^/]+).*$" .Values.redis.external.url "${1}" -}}
{{- end -}}
{{- end -}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://:$(REDIS_PASSWORD)@{{ include "pdserve.redisAddress" . }}/0
{{- else -}}
{{- regexReplaceAll "^(rediss?://)" .Values.redis.external.url "${1}:$(REDIS_PASSWORD)@" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecret" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end -}}

{{/* Every process that talks to Ray: token authentication, no usage stats, actors at nice 0
(Ray's default, 15, puts the serving path below Ray's own daemons) */}}
{{- define "pdserve.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.raySecret" . }}
      key: {{ .Values.ray.auth.secretKey }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: RAY_worker_niceness
  value: "0"
{{- end -}}

{{- define "pdserve.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The model volume, its mount, the optional fetching init container */}}
{{- define "pdserve.modelVolumes" -}}
{{- if .Values.model.path }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
- name: shm
  emptyDir:
    medium: Memory
{{- end -}}
{{- define "pdserve.modelMounts" -}}
{{- if .Values.model.path }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ empty .Values.model.fetch }}
{{- end }}
- name: shm
  mountPath: /dev/shm
{{- end -}}
{{- define "pdserve.modelFetch" -}}
{{- if and .Values.model.path .Values.model.fetch }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.fetch.image }}
    command: {{ toJson .Values.model.fetch.command }}
    securityContext:
      {{- include "pdserve.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end -}}

{{/* Ray's own health endpoints (the dashboard agent's raylet check; the head's GCS check) */}}
{{- define "pdserve.rayProbe" -}}
exec:
  command:
    - python
    - -c
    - "import sys, urllib.request as u; sys.exit(0 if b'success' in u.urlopen('http://127.0.0.1:{{ .port }}/api/{{ .path }}', timeout=3).read() else 1)"
periodSeconds: 10
timeoutSeconds: 5
failureThreshold: {{ .failureThreshold | default 6 }}
{{- end -}}

{{/* flags from a map: true/false as --x/--no-x, a list as --x A B ..., else --x VALUE */}}
{{- define "pdserve.flags" -}}
{{- range $key, $value := . }}
{{- if has $key (list "api-key" "admin-api-key" "priority-api-key" "redis-password" "redis-url") }}
{{- fail (printf "%s: secrets never go in pdserve's arguments; use the chart's apiKey, adminApiKey, priorityApiKeys or redis values (Kubernetes Secrets)" $key) }}
{{- end }}
{{- if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) $key | quote }}
{{- else if kindIs "slice" $value }}
- {{ printf "--%s" $key | quote }}
{{- range $value }}
- {{ . | toString | quote }}
{{- end }}
{{- else }}
- {{ printf "--%s" $key | quote }}
- {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.engineArgs" -}}
{{- range $key, $value := .Values.prefill.engineArgs }}
{{- if and (hasKey $.Values.decode.engineArgs $key) (ne (toString $value) (toString (index $.Values.decode.engineArgs $key))) }}
{{- fail (printf "prefill.engineArgs.%s and decode.engineArgs.%s differ: pdserve runs one engine configuration for every worker" $key $key) }}
{{- end }}
{{- end }}
{{- include "pdserve.flags" (merge (dict) .Values.prefill.engineArgs .Values.decode.engineArgs) }}
{{- end -}}

{{/* GPUs a pool's pods have (its nvidia.com/gpu limit), "" for none */}}
{{- define "pdserve.gpus" -}}
{{- $limits := .resources.limits | default dict -}}
{{- index $limits "nvidia.com/gpu" | default "" -}}
{{- end -}}

{{/* The routers' gRPC health (grpc.health.v1) through their Service: SERVING or not */}}
{{- define "pdserve.routerHealth" -}}
- python
- -c
- "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('{{ include "pdserve.fullname" . }}-router:{{ .Values.router.service.grpcPort }}'); sys.exit(0 if g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=3).status == 1 else 1)"
{{- end -}}

{{/* A ServiceMonitor's or PodMonitor's endpoint credentials: /metrics wants the admin key
when there is one */}}
{{- define "pdserve.metricsAuthorization" -}}
{{- if .Values.adminApiKey.existingSecret -}}
authorization:
  type: Bearer
  credentials:
    name: {{ .Values.adminApiKey.existingSecret }}
    key: {{ .Values.adminApiKey.secretKey }}
{{- end -}}
{{- end -}}
