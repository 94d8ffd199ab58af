{{/* Names and labels. */}}
{{- define "tessera.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.labels" -}}
{{ include "tessera.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tessera.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-settings" (include "tessera.fullname" .)) -}}
{{- end -}}

{{/* The engine workers' headless Service; each pod is <statefulset>-<i>.<service>. */}}
{{- define "tessera.engineService" -}}
{{- printf "%s-engine" (include "tessera.fullname" .) -}}
{{- end -}}

{{/* TESSERA_ENGINE_URLS: one URL per engine replica, by its stable DNS name (JSON list). */}}
{{- define "tessera.engineUrls" -}}
{{- $svc := include "tessera.engineService" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $svc $i $svc $.Release.Namespace (int $.Values.engine.port)) -}}
{{- end -}}
{{- toJson $urls -}}
{{- end -}}

{{/* A generated secret value kept across upgrades: the release Secret's current one if any. */}}
{{- define "tessera.keptSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace (printf "%s-settings" (include "tessera.fullname" .root)) -}}
{{- if and $existing (index $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 40 -}}
{{- end -}}
{{- end -}}

{{/* What every Tessera container shares: settings from the ConfigMap and the Secret. */}}
{{- define "tessera.envFrom" -}}
- configMapRef:
    name: {{ include "tessera.fullname" . }}-settings
- secretRef:
    name: {{ include "tessera.secretName" . }}
{{- end -}}

{{/* Writable paths under a read-only root file system: the image's state folder and /tmp. */}}
{{- define "tessera.volumeMounts" -}}
- name: state
  mountPath: /var/lib/tessera
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "tessera.volumes" -}}
- name: state
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end -}}

{{/* Restarts pods when the values behind their settings change (the values, not the rendered
Secret: a generated secret would make every render differ). */}}
{{- define "tessera.checksums" -}}
checksum/settings: {{ list .Values.database .Values.redis .Values.s3 .Values.secrets .Values.settings (include "tessera.engineUrls" .) | toJson | sha256sum }}
{{- end -}}

{{- define "tessera.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
