{{/* The prefix of every object's name: the release name, or fullnameOverride. */}}
{{- define "loraplex.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.labels" -}}
app.kubernetes.io/part-of: loraplex
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{/* A Secret's name: the one given in values, else <fullname>-<suffix>. */}}
{{- define "loraplex.secretName" -}}
{{- $ref := index . 0 -}}{{- $root := index . 1 -}}{{- $suffix := index . 2 -}}
{{- default (printf "%s-%s" (include "loraplex.fullname" $root) $suffix) $ref.name -}}
{{- end -}}

{{/* The worker image: the GPU image (vLLM's base) unless the native engine runs without a GPU. */}}
{{- define "loraplex.workerImage" -}}
{{- $w := .Values.worker -}}
{{- $cpu := and (eq $w.engine "native") (eq (int $w.gpus) 0) -}}
{{- $tag := default (printf "%s%s" .Chart.AppVersion (ternary "-cpu" "" $cpu)) $w.image.tag -}}
{{- printf "%s:%s" $w.image.repository $tag -}}
{{- end -}}

{{/* The worker's `serve --config` file: worker.serve, with the host cache's default for the engine
(worker.hostCache) where it sets none. values.schema.json has checked each key as serve does. */}}
{{- define "loraplex.serveSettings" -}}
{{- $w := .Values.worker -}}
{{- $serve := deepCopy ($w.serve | default dict) -}}
{{- if not (or (hasKey $serve "cpu-cache-bytes") (hasKey $serve "max-cpu-loras")) }}
{{- $serve = merge $serve (deepCopy (index $w.hostCache $w.engine)) }}
{{- end }}
{{- toYaml $serve }}
{{- end -}}
