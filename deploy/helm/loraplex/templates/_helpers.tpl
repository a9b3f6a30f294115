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

{{/* The worker groups as JSON, one pool each: workerGroups, or (empty) one group of `worker`'s own
values. Each: name ("" for the default group), object (its objects' name), kind (StatefulSet
when the router routes to its pods by name, else Deployment), base (the served name), claimName,
maxRank, tenants, role, replicas, serve (worker.serve with the group's keys over it), autoscaling. */}}
{{- define "loraplex.groups" -}}
{{- $w := .Values.worker -}}
{{- $name := include "loraplex.fullname" . -}}
{{- $kind := ternary "StatefulSet" "Deployment" .Values.router.enabled -}}
{{- $groups := list -}}
{{- $seen := dict -}}
{{- range .Values.workerGroups -}}
{{- if hasKey $seen .name }}{{ fail (printf "workerGroups: the name %s is given twice" .name) }}{{ end -}}
{{- $_ := set $seen .name true -}}
{{- $serve := merge (deepCopy (.serve | default dict)) (deepCopy ($w.serve | default dict)) -}}
{{- if and .maxRank (not (hasKey $serve "max-lora-rank")) }}{{ $_ := set $serve "max-lora-rank" .maxRank }}{{ end -}}
{{- $scale := merge (deepCopy (.autoscaling | default dict)) (deepCopy $w.autoscaling) -}}
{{- $model := .model | default dict -}}
{{- $groups = append $groups (dict "name" .name "object" (printf "%s-worker-%s" $name .name) "kind" $kind "base" $model.servedName "claimName" (default $w.model.claimName $model.claimName) "maxRank" (.maxRank | default 0) "tenants" (.tenants | default list) "role" (.role | default "") "replicas" (default $w.replicas .replicas) "serve" $serve "autoscaling" $scale) -}}
{{- end -}}
{{- if not $groups -}}
{{- $groups = list (dict "name" "" "object" (printf "%s-worker" $name) "kind" $kind "base" $w.model.servedName "claimName" $w.model.claimName "maxRank" 0 "tenants" list "role" "" "replicas" $w.replicas "serve" (deepCopy ($w.serve | default dict)) "autoscaling" $w.autoscaling) -}}
{{- end -}}
{{- range $groups -}}
{{- $rank := get .serve "max-lora-rank" -}}
{{- if and .maxRank $rank (lt (int $rank) (int .maxRank)) -}}
{{- fail (printf "worker group %s: serve's max-lora-rank %v is below its maxRank %v (the router would refuse its workers)" .name $rank .maxRank) -}}
{{- end -}}
{{- $a := .autoscaling -}}
{{- if and (ne $a.mode "none") (lt (int $a.maxReplicas) (int $a.minReplicas)) -}}
{{- fail (printf "worker group %s: autoscaling.maxReplicas %v is below minReplicas %v" (default "worker" .name) $a.maxReplicas $a.minReplicas) -}}
{{- end -}}
{{- end -}}
{{- toJson $groups -}}
{{- end -}}

{{/* The InferencePools, one per base model as JSON: name (the default group's: <fullname>; else
<fullname>-<base>), base, and group (the name of a group of it; "" for the default group). */}}
{{- define "loraplex.bases" -}}
{{- $name := include "loraplex.fullname" . -}}
{{- $pools := list -}}
{{- $seen := dict -}}
{{- range (include "loraplex.groups" . | fromJsonArray) -}}
{{- if not (hasKey $seen .base) -}}
{{- $_ := set $seen .base true -}}
{{- $pool := ternary $name (printf "%s-%s" $name (.base | lower | replace "." "-" | replace "_" "-")) (eq .name "") -}}
{{- $pools = append $pools (dict "name" $pool "base" .base "group" .name) -}}
{{- end -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/* A worker pod's labels that pick it: its group's (and its base's) beside the name. */}}
{{- define "loraplex.workerSelector" -}}
{{- $root := index . 0 -}}{{- $group := index . 1 -}}
app.kubernetes.io/name: {{ include "loraplex.fullname" $root }}-worker
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- if $group.name }}
loraplex/group: {{ $group.name }}
{{- end }}
{{- end -}}

{{/* The URLs of a group's pods, by their stable names under the group's headless Service: up
to its replicas, or to autoscaling.maxReplicas (the router finds the missing ones unhealthy). */}}
{{- define "loraplex.workerURLs" -}}
{{- $root := index . 0 -}}{{- $group := index . 1 -}}{{- $port := index . 2 -}}
{{- $count := ternary $group.autoscaling.maxReplicas $group.replicas (ne $group.autoscaling.mode "none") -}}
{{- $urls := list -}}
{{- range until (int $count) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s-pods.%s.svc:%v" $group.object . $group.object $root.Release.Namespace $port) -}}
{{- end -}}
{{- join "+" $urls -}}
{{- end -}}

{{/* The worker groups as `loraplex router` and `loraplex placement` take them, given (list
context port): each named group one --pool (its base model, max rank, tenants, role and pods by
name on `port`), the default group's pods --worker (the shared pool). */}}
{{- define "loraplex.poolArgs" -}}
{{- $root := index . 0 -}}{{- $port := index . 1 -}}
{{- range $group := include "loraplex.groups" $root | fromJsonArray }}
{{- $urls := include "loraplex.workerURLs" (list $root $group $port) }}
{{- if $group.name }}
{{- $spec := list (printf "name=%s" $group.name) (printf "base-model=%s" $group.base) }}
{{- if $group.maxRank }}{{ $spec = append $spec (printf "max-rank=%v" $group.maxRank) }}{{ end }}
{{- if $group.tenants }}{{ $spec = append $spec (printf "tenants=%s" (join "+" $group.tenants)) }}{{ end }}
{{- if $group.role }}{{ $spec = append $spec (printf "role=%s" $group.role) }}{{ end }}
- --pool={{ join "," (append $spec (printf "workers=%s" $urls)) }}
{{- else }}
{{- range splitList "+" $urls }}
- --worker={{ . }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A group's `serve --config` file: its serve settings, with the host cache's default for the
engine (worker.hostCache) where it sets none, and store.url added to its allowed-roots.
values.schema.json has checked each key as serve does. */}}
{{- define "loraplex.serveSettings" -}}
{{- $root := index . 0 -}}{{- $group := index . 1 -}}
{{- $w := $root.Values.worker -}}
{{- $serve := deepCopy ($group.serve | default dict) -}}
{{- if not (or (hasKey $serve "cpu-cache-bytes") (hasKey $serve "max-cpu-loras")) }}
{{- $serve = merge $serve (deepCopy (index $w.hostCache $w.engine)) }}
{{- end }}
{{- with include "loraplex.storeURL" $root }}
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
