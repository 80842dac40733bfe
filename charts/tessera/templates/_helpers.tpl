{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
