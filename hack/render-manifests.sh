#!/usr/bin/env bash
# Render the plain manifests under deploy/ from the Helm chart, the one source of both.
#   hack/render-manifests.sh          write deploy/device-plugin.yaml and deploy/extender.yaml
#   hack/render-manifests.sh --check  exit 1 if they differ from what the chart renders
set -euo pipefail
cd "$(dirname "$0")/.."
helm="${HELM:-$(hack/k8s-binaries.sh 2>/dev/null)/helm}"
status=0
for part in device-plugin extender; do
  rendered="$(mktemp)"
  {
    echo "# Rendered from charts/tessera (templates/$part.yaml) by hack/render-manifests.sh: edit the chart."
    echo "# Apply: kubectl apply -f deploy/$part.yaml"
    "$helm" template tessera charts/tessera --namespace kube-system \
      --show-only "templates/$part.yaml" 2>/dev/null
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
