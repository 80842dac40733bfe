#!/usr/bin/env bash
# A kind cluster with Tessera installed from its chart, for users with Docker (or Podman); the same
# values as a real cluster: no fake GPU driver, no deploy/sandbox-values.yaml. Not run in CI here:
# these machines have no container engine and no registry (docs/install.md, "kind").
#
#   hack/kind-up.sh            create the cluster "tessera", build and load the images, install
#   KIND_CLUSTER=name ...      another cluster name
#
# Needs: docker (or podman, KIND_EXPERIMENTAL_PROVIDER=podman), kind, kubectl, helm.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster="${KIND_CLUSTER:-tessera}"
version="$(sed -nE 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n1)"
image="tessera:$version"

for tool in kind kubectl helm docker; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is missing" >&2; exit 1; }
done

if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --config hack/kind-config.yaml
fi
context="kind-$cluster"

# The product image from the repository's Dockerfile; the chart's kube-scheduler image is the public
# one of the node's version (the chart asks for the cluster's version).
docker build -t "$image" .
k8s="$(kubectl --context "$context" version -o json | sed -nE 's/.*"gitVersion": "(v[0-9]+\.[0-9]+\.[0-9]+).*/\1/p' | tail -n1)"
docker pull "registry.k8s.io/kube-scheduler:$k8s"
kind load docker-image --name "$cluster" "$image" "registry.k8s.io/kube-scheduler:$k8s"

helm --kube-context "$context" upgrade --install tessera charts/tessera \
  --namespace tessera-system --create-namespace \
  --set image.pullPolicy=Never --set scheduler.image.pullPolicy=Never \
  --set-json 'devicePlugin.nodeSelector={"tessera.io/gpu-node":"true"}' \
  --wait --timeout 5m
kubectl --context "$context" get pods -n tessera-system -o wide
echo "kind-up: done. Try: kubectl --context $context apply -f deploy/examples/shared-gpu.yaml (needs GPUs in the worker)"
