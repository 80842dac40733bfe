#!/usr/bin/env bash
# Build Prometheus and promtool from Go modules into a cache directory outside the work tree, with
# Kubernetes service discovery (Debian's prometheus package has none), for `tessera sandbox up
# --monitoring` and tests/monitoring. Later runs reuse the binaries.
#
#   hack/prometheus-binaries.sh              build what is missing, print the bin directory
#   TESSERA_PROMETHEUS_CACHE=/dir ...        choose the cache (default ~/.cache/tessera/prometheus-<version>)
#
# Prometheus 3's module is github.com/prometheus/prometheus at v0.<major><minor>.<patch> (3.16.0 is
# v0.316.0) and has no replace directives, so `go install pkg@version` builds it as released.
# Discovery: upstream's plugins/ registers every mechanism unless the build tag remove_all_sd is set,
# then only those named by enable_<name>_sd (file and HTTP always stay): only Kubernetes is linked,
# no cloud SDK. The web UI's assets are not embedded (no builtinassets tag): the HTTP API is all the
# sandbox and the tests use. promtool is built the same way, so `promtool check config` understands
# kubernetes_sd_configs and the rule unit tests run the same PromQL engine as the server.
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v3.16.0}"

IFS=. read -r major minor patch <<<"${PROMETHEUS_VERSION#v}"
module_version="v0.$((major * 100 + minor)).$patch"
cache="${TESSERA_PROMETHEUS_CACHE:-$HOME/.cache/tessera/prometheus-$PROMETHEUS_VERSION}"
bin="$cache/bin"
mkdir -p "$bin"

if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then
  echo "$bin"
  exit 0
fi

# shellcheck source=hack/go-env.sh
. "$(dirname "$0")/go-env.sh"
pkg=github.com/prometheus/common/version
echo "prometheus-binaries: building Prometheus $PROMETHEUS_VERSION ($module_version) with Kubernetes discovery" >&2
CGO_ENABLED=0 GOFLAGS= GOBIN="$bin" go install -trimpath \
  -tags remove_all_sd,enable_kubernetes_sd \
  -ldflags "-s -w -X $pkg.Version=${PROMETHEUS_VERSION#v} -X $pkg.Branch=release -X $pkg.BuildUser=tessera" \
  "github.com/prometheus/prometheus/cmd/prometheus@$module_version" \
  "github.com/prometheus/prometheus/cmd/promtool@$module_version"
echo "$bin"
