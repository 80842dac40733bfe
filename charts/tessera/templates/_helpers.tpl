{{/* The Tessera image: registry/repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "tessera.image" -}}
{{- $img := .Values.image -}}
{{- $tag := $img.tag | default .Chart.AppVersion -}}
{{- if $img.registry -}}{{ $img.registry }}/{{- end -}}{{ $img.repository }}:{{ $tag }}
{{- end -}}

{{/* kube-scheduler's image: scheduler.image.tag, else the cluster's version (v<major>.<minor>.<patch>,
     build metadata and pre-release suffixes dropped): kube-scheduler must not be newer than the API
     server, and the same minor is the safest. */}}
{{- define "tessera.schedulerImage" -}}
{{- $img := .Values.scheduler.image -}}
{{- $tag := $img.tag -}}
{{- if not $tag -}}
{{- $v := .Capabilities.KubeVersion.Version | trimPrefix "v" | regexFind "^[0-9]+\\.[0-9]+\\.[0-9]+" -}}
{{- $tag = printf "v%s" $v -}}
{{- end -}}
{{- if $img.registry -}}{{ $img.registry }}/{{- end -}}{{ $img.repository }}:{{ $tag }}
{{- end -}}

{{/* A cluster-scoped object's name, after the release: tessera.clusterName (list . "device-plugin"). */}}
{{- define "tessera.clusterName" -}}
{{- printf "%s-%s" (index . 0).Release.Name (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* imagePullSecrets of every pod. */}}
{{- define "tessera.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A component's scheduling fields (priorityClassName, nodeSelector, affinity, tolerations), from its
     values: include "tessera.podScheduling" .Values.extender | nindent 6 */}}
{{- define "tessera.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
