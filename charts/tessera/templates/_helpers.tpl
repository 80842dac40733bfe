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

{{/* The node agent's scheduling: its values' (tessera.podScheduling), with a node affinity that keeps
     it off nodes labelled <domain>/mode for the other agent, added to each of the user's required
     terms (terms are ORed, so every one needs it). mode: mixed runs the DRA driver only where the
     label says dra. A node never gets both agents from a release (docs/dra.md, "One mode per node").
     include "tessera.agentScheduling" (list . "dra") */}}
{{- define "tessera.agentScheduling" -}}
{{- $root := index . 0 }}
{{- $agent := index . 1 }}
{{- $dp := $root.Values.devicePlugin }}
{{- $key := printf "%s/mode" $root.Values.domain }}
{{- $expression := dict "key" $key "operator" "NotIn" "values" (list (ternary "deviceplugin" "dra" (eq $agent "dra"))) }}
{{- if and (eq $root.Values.mode "mixed") (eq $agent "dra") }}
{{- $expression = dict "key" $key "operator" "In" "values" (list "dra") }}
{{- end }}
{{- $affinity := deepCopy ($dp.affinity | default dict) }}
{{- $node := $affinity.nodeAffinity | default dict }}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := list }}
{{- range ($required.nodeSelectorTerms | default (list dict)) }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (append ($term.matchExpressions | default list) $expression) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- include "tessera.podScheduling" (merge (dict "affinity" $affinity) (deepCopy $dp)) }}
{{- end -}}

{{/* The service account the extender runs as: beside the chart's scheduler it shares that pod's
     account; standalone, its own. The placement-annotations policy trusts this name. */}}
{{- define "tessera.extenderServiceAccount" -}}
{{- if .Values.scheduler.enabled -}}{{ .Values.scheduler.name }}{{- else -}}tessera-extender{{- end -}}
{{- end -}}

{{/* The QoS class rule's flags (tessera/cliargs.py add_qos_class_flags), from extender.qos: the
     extender grants pods their class by them, the DRA driver claims. include "tessera.qosArgs" . */}}
{{- define "tessera.qosArgs" -}}
{{- $qos := .Values.extender.qos -}}
- --qos-latency-critical-priority={{ int64 $qos.latencyCriticalPriority }}
- --qos-best-effort-priority={{ int64 $qos.bestEffortPriority }}
{{- with $qos.latencyCriticalNamespaces }}
- --qos-latency-critical-namespaces={{ join "," . }}
{{- end }}
{{- end -}}

{{/* The extender's container, the same in both of its homes: beside the chart's kube-scheduler in
     one pod (verbs on the pod's loopback only, where no other pod can reach them) or standalone
     behind its Service for the cluster's own scheduler (verbs on every address; TLS as configured).
     include "tessera.extenderContainer" (dict "root" . "standalone" true) */}}
{{- define "tessera.extenderContainer" -}}
{{- $root := .root -}}
{{- $ext := $root.Values.extender -}}
{{- $tls := and .standalone $ext.tls.enabled -}}
- name: extender
  image: {{ include "tessera.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["tessera-extender"]
  args:
    - --listen={{ if .standalone }}0.0.0.0{{ else }}127.0.0.1{{ end }}:{{ $ext.port }}
    - --policy={{ $ext.policy }}
    - --speed-profiles=/etc/tessera/speed-profiles.yaml
    - --heartbeat-timeout={{ $ext.heartbeatTimeoutSeconds }}
    - --inflight-timeout={{ $root.Values.inflightTimeout }}
    - --filter-keeps={{ $ext.filterKeeps }}
    {{- include "tessera.qosArgs" $root | nindent 4 }}
    {{- with $ext.bestEffortOversubscription }}
    {{- if .enabled }}
    - --best-effort-oversubscription
    - --best-effort-margin-mib={{ int64 .marginMiB }}
    - --best-effort-margin-percent={{ .marginPercent }}
    - --best-effort-usage-max-age={{ .usageMaxAgeSeconds }}
    {{- end }}
    {{- end }}
    - --domain={{ $root.Values.domain }}
    - --scheduler-name={{ $root.Values.scheduler.name }}
    - --health-listen=0.0.0.0:{{ $ext.healthPort }}
    - --metrics-authorization={{ ternary "kubernetes" "none" $root.Values.metricsAccess.authorization }}
    {{- if not .standalone }}
    # Bind only while the kube-scheduler in this pod leads (its Lease): a replica losing the lead
    # may still have binds in flight, which the new leader's extender does not count.
    - --leader-lease={{ $root.Release.Namespace }}/{{ $root.Values.scheduler.name }}
    {{- end }}
    {{- if $tls }}
    - --tls-cert-file=/etc/tessera-tls/tls.crt
    - --tls-key-file=/etc/tessera-tls/tls.key
    - --client-ca-file=/etc/tessera-tls/ca.crt
    {{- end }}
  {{- if not .standalone }}
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
  {{- end }}
  # The image's own non-root user; the extender needs no privilege (docs/install.md).
  securityContext:
    runAsNonRoot: true
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: ["ALL"]}
  ports:
    {{- if .standalone }}
    # kube-scheduler's verbs ({{ if $tls }}HTTPS, client certificate required{{ else }}plain HTTP{{ end }}).
    - {name: verbs, containerPort: {{ $ext.port }}}
    {{- end }}
    # Probes and metrics only: this port serves no verb.
    - {name: http, containerPort: {{ $ext.healthPort }}}
  # Ready once its node and pod caches are synced: before that it would place pods blind.
  readinessProbe:
    httpGet: {path: /readyz, port: http}
    periodSeconds: 2
  livenessProbe:
    httpGet: {path: /healthz, port: http}
    periodSeconds: 10
  {{- with $ext.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: speed-profiles, mountPath: /etc/tessera, readOnly: true}
    {{- if $tls }}
    - {name: tls, mountPath: /etc/tessera-tls, readOnly: true}
    {{- end }}
{{- end -}}

{{/* The node agent's init container (both modes): installs the hook on the host where containers
     mount it from. A rename, not an overwrite: running containers keep the library they mapped. */}}
{{- define "tessera.installHook" -}}
# Install the hook on the host where containers mount it from. A rename, not an overwrite:
# running containers keep the library they mapped.
- name: install-hook
  image: {{ include "tessera.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  # The image's user is not root; the host's hook dir is root's (docs/install.md).
  securityContext:
    runAsUser: 0
  command:
    - sh
    - -c
    - cp /usr/local/tessera/libvgpu.so /host-hook/.libvgpu.so.new && mv -f /host-hook/.libvgpu.so.new /host-hook/libvgpu.so
  volumeMounts:
    - name: hook
      mountPath: /host-hook
{{- end -}}
