#!/usr/bin/env bash
# Render the plain manifests under deploy/ from the Helm chart, the one source of both: the node agent
# and the standalone extender (scheduler.enabled=false) that deploy/scheduler-config.yaml calls.
#   hack/render-manifests.sh          write deploy/device-plugin.yaml, deploy/extender.yaml and
#                                     deploy/dra-driver.yaml (the node agent in DRA mode, docs/dra.md);
#                                     the first two with who may read their /metrics (metrics-access.yaml)
#   hack/render-manifests.sh --check  exit 1 if they differ from what the chart renders
# The extender's Service gets the fixed ClusterIP that deploy/scheduler-config.yaml calls: a
# kube-scheduler on the host network cannot resolve cluster DNS names, but kube-proxy makes
# ClusterIPs reachable from the host. 10.96.0.88 is in the static band (the first 256 addresses) of
# kubeadm's default Service CIDR 10.96.0.0/12, which dynamic allocation avoids (docs/install.md).
EXTENDER_CLUSTER_IP=10.96.0.88
set -euo pipefail
cd "$(dirname "$0")/.."
helm="${HELM:-$(hack/k8s-binaries.sh 2>/dev/null)/helm}"
status=0
for part in device-plugin extender dra-driver; do
  rendered="$(mktemp)"
  {
    echo "# Rendered from charts/tessera (templates/$part.yaml) by hack/render-manifests.sh: edit the chart."
    echo "# Apply: kubectl apply -f deploy/$part.yaml"
    "$helm" template tessera charts/tessera --namespace kube-system \
      --set scheduler.enabled=false \
      --set "extender.service.clusterIP=$EXTENDER_CLUSTER_IP" \
      $([ "$part" = dra-driver ] && echo --set mode=dra) \
      --show-only "templates/$part.yaml" \
      $([ "$part" != dra-driver ] && echo --show-only templates/metrics-access.yaml) 2>/dev/null
  } >"$rendered"
  if [ "${1:-}" = "--check" ]; then
    if ! diff -u "deploy/$part.yaml" "$rendered"; then
      echo "deploy/$part.yaml is stale: run hack/render-manifests.sh" >&2
      status=1
    fi
    rm -f "$rendered"
  else
    mv "$rendered" "deploy/$part.yaml"
  fi
done
exit $status
