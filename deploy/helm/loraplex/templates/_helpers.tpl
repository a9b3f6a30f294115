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
(worker.hostCache) where it sets none, and store.url added to its allowed-roots. values.schema.json
has checked each key as serve does. */}}
{{- define "loraplex.serveSettings" -}}
{{- $w := .Values.worker -}}
{{- $serve := deepCopy ($w.serve | default dict) -}}
{{- if not (or (hasKey $serve "cpu-cache-bytes") (hasKey $serve "max-cpu-loras")) }}
{{- $serve = merge $serve (deepCopy (index $w.hostCache $w.engine)) }}
{{- end }}
{{- with include "loraplex.storeURL" . }}
{{- $roots := get $serve "allowed-roots" | default list -}}
{{- $roots = ternary (list $roots) $roots (kindIs "string" $roots) -}}
{{- $_ := set $serve "allowed-roots" (append $roots (trimSuffix "/" .) | uniq) }}
{{- end }}
{{- toYaml $serve }}
{{- end -}}

{{/* The store's URL: store.url, or the bundled distribution registry's repository. */}}
{{- define "loraplex.storeURL" -}}
{{- if .Values.store.bundled.enabled -}}
{{- printf "oci+http://%s-store:5000/loras" (include "loraplex.fullname" .) -}}
{{- else -}}
{{- trimSuffix "/" .Values.store.url -}}
{{- end -}}
{{- end -}}

{{/* The store's kind: oci (oci:// or oci+http://), s3, volume (a directory), or none. */}}
{{- define "loraplex.storeKind" -}}
{{- $url := include "loraplex.storeURL" . -}}
{{- if hasPrefix "oci" $url }}oci{{ else if hasPrefix "s3://" $url }}s3{{ else if hasPrefix "/" $url }}volume{{ else }}none{{ end -}}
{{- end -}}
