#!/usr/bin/env bash
# Build the real Kubernetes control plane (and kubelet, kube-proxy, kubectl, etcd, CoreDNS, helm,
# containerd) from Go modules into a cache directory outside the work tree, so tests run against real binaries and later runs reuse them.
#
#   hack/k8s-binaries.sh            build what is missing, print the bin directory
#   TESSERA_K8S_CACHE=/dir ...      choose the cache (default ~/.cache/tessera/k8s-<version>)
#   TESSERA_TOOLS_CACHE=/dir ...    where etcd, CoreDNS and containerd are built (default
#                                   ~/.cache/tessera): they
#                                   do not depend on the Kubernetes version, so each version's bin
#                                   directory links the same build
#
# Why a scratch module: k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them
# with in-tree paths, which `go install pkg@version` refuses; a main module that replaces every
# staging module with its published v0.<minor>.<patch> resolves cleanly.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.10}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.14}"
HELM_VERSION="${HELM_VERSION:-v3.19.5}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.4.2}"

staging_version="v0.${K8S_VERSION#v1.}"
k8s_minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
cache="${TESSERA_K8S_CACHE:-$HOME/.cache/tessera/k8s-$K8S_VERSION}"
bin="$cache/bin"
tools="${TESSERA_TOOLS_CACHE:-$HOME/.cache/tessera}"
mkdir -p "$bin" "$cache/src"

log() { echo "k8s-binaries: $*" >&2; }

# shellcheck source=hack/go-env.sh
. "$(dirname "$0")/go-env.sh"
export CGO_ENABLED=0 GOFLAGS=-mod=mod

have_all() { for b in "$@"; do [ -x "$bin/$b" ] || return 1; done; }

# Link a version-independent tool built at $2 (by the function $3 when missing) into the bin dir.
# Both versions' builds may run at once (`make -j k8s-binaries`): the first to get the tool's lock
# builds it, the other waits and links it.
link_tool() {
  local name="$1" built="$2" build="$3"
  have_all "$name" && return 0
  mkdir -p "$(dirname "$built")"
  (
    flock 9
    [ -x "$built" ] || "$build" "$built"
  ) 9>"$(dirname "$built")/.build.lock"
  ln -sf "$built" "$bin/$name"
}

build_kubernetes() {
  have_all kube-apiserver kube-scheduler kubelet kubectl kube-controller-manager kube-proxy && return 0
  local mod="$cache/src/kubernetes"
  mkdir -p "$mod"
  if [ ! -f "$mod/go.mod" ]; then
    # The staging modules, the go directive and the godebug default differ between minors (1.37 adds
    # cri-streaming and streaming, says go 1.26.0): take them from the pinned Kubernetes go.mod.
    local upstream go_directive godebug m
    upstream="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -nE 's/^\t"GoMod": "(.*)",$/\1/p')"
    [ -f "$upstream" ] || { log "no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
    go_directive="$(sed -nE 's/^go ([0-9.]+)$/\1/p' "$upstream")"
    godebug="$(sed -nE 's/^godebug (default=go[0-9.]+)$/\1/p' "$upstream")"
    (cd "$mod" && go mod init example.local/k8sbuild >/dev/null 2>&1 &&
      go mod edit -go="$go_directive" -godebug="${godebug:-default=go$go_directive}" \
        -require="k8s.io/kubernetes@$K8S_VERSION")
    for m in $(sed -nE 's#^\s*(k8s\.io/[a-z0-9-]+) => \./staging/.*#\1#p' "$upstream"); do
      (cd "$mod" && go mod edit -replace="$m=$m@$staging_version")
    done
    printf 'package tools\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n\t_ "k8s.io/kubernetes/cmd/kube-scheduler"\n\t_ "k8s.io/kubernetes/cmd/kube-controller-manager"\n\t_ "k8s.io/kubernetes/cmd/kubelet"\n\t_ "k8s.io/kubernetes/cmd/kube-proxy"\n\t_ "k8s.io/kubernetes/cmd/kubectl"\n)\n' >"$mod/tools.go"
    sed -i '1s/^/\/\/go:build tools\n\n/' "$mod/tools.go"
  fi
  local date ldf="-s -w" p
  date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$k8s_minor"
    ldf="$ldf -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  log "building Kubernetes $K8S_VERSION (cold: tens of minutes on 2 cores)"
  (cd "$mod" && go build -trimpath -tags selinux,notest -ldflags "$ldf" -o "$bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl)
}

build_etcd() {
  local out="$1" mod
  mod="$(dirname "$out")/src"
  mkdir -p "$mod"
  if [ ! -f "$mod/go.mod" ]; then
    (cd "$mod" && go mod init example.local/etcdbuild >/dev/null 2>&1 &&
      go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION")
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >"$mod/tools.go"
  fi
  log "building etcd $ETCD_VERSION"
  (cd "$mod" && go build -trimpath \
    -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
    -o "$out" go.etcd.io/etcd/server/v3)
}

build_helm() {
  have_all helm && return 0
  local pkg=helm.sh/helm/v3
  log "building helm $HELM_VERSION"
  GOBIN="$bin" GOFLAGS= go install -trimpath -ldflags "-s -w \
    -X $pkg/internal/version.version=$HELM_VERSION -X $pkg/internal/version.gitTreeState=clean \
    -X $pkg/pkg/chartutil.k8sVersionMajor=1 -X $pkg/pkg/chartutil.k8sVersionMinor=$k8s_minor \
    -X $pkg/pkg/lint/rules.k8sVersionMajor=1 -X $pkg/pkg/lint/rules.k8sVersionMinor=$k8s_minor" \
    "$pkg/cmd/helm@$HELM_VERSION"
}

# Cluster DNS: the chart's kube-scheduler calls the extender by its Service name
# (tessera-extender.<namespace>.svc). A main package with only the plugins a cluster DNS needs
# (upstream's coredns.go links all ~60, with cloud SDKs), registered in upstream's plugin.cfg order.
build_coredns() {
  local out="$1" mod
  mod="$(dirname "$out")/src"
  mkdir -p "$mod"
  if [ ! -f "$mod/go.mod" ]; then
    (cd "$mod" && go mod init example.local/corednsbuild >/dev/null 2>&1 &&
      go mod edit -require="github.com/coredns/coredns@$COREDNS_VERSION")
    cat >"$mod/main.go" <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The order plugins run in, as in upstream's plugin.cfg.
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "forward"}
}

func main() { coremain.Run() }
GO
  fi
  log "building CoreDNS $COREDNS_VERSION"
  (cd "$mod" && go build -trimpath \
    -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
    -o "$out" .)
}

# containerd 2.x for the DRA sandbox: the kubelet hands a claim's CDI device names to the runtime
# (CRI CDIDevices), which Debian's containerd 1.6 drops. Only containerd, its runc shim and ctr (the
# sandbox imports images with it); no_btrfs/no_devmapper/no_zfs leave out snapshotters the sandbox
# disables anyway, no_grpc the shim's unused gRPC server (both as upstream's Makefile does).
build_containerd() {
  local out="$1" dir mod pkg=github.com/containerd/containerd/v2 ldf tags=no_btrfs,no_devmapper,no_zfs,urfave_cli_no_docs
  dir="$(dirname "$out")"
  mod="$dir/src"
  mkdir -p "$mod"
  if [ ! -f "$mod/go.mod" ]; then
    (cd "$mod" && go mod init example.local/containerdbuild >/dev/null 2>&1 &&
      go mod edit -require="$pkg@$CONTAINERD_VERSION")
    printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "%s/cmd/containerd"\n\t_ "%s/cmd/containerd-shim-runc-v2"\n\t_ "%s/cmd/ctr"\n)\n' \
      "$pkg" "$pkg" "$pkg" >"$mod/tools.go"
  fi
  ldf="-s -w -X $pkg/version.Version=$CONTAINERD_VERSION -X $pkg/version.Package=$pkg"
  log "building containerd $CONTAINERD_VERSION"
  (cd "$mod" && go build -trimpath -tags "$tags" -ldflags "$ldf" -o "$dir/" "$pkg/cmd/containerd" "$pkg/cmd/ctr" &&
    go build -trimpath -tags "$tags,no_grpc" -ldflags "$ldf" -o "$dir/" "$pkg/cmd/containerd-shim-runc-v2")
}

link_tool etcd "$tools/etcd-$ETCD_VERSION/etcd" build_etcd
# Helm is built per version (its default .Capabilities.KubeVersion is the minor it is built for), one
# build at a time: the second then finds every package in Go's build cache and only links (seconds),
# where two at once would each compile all of helm.
mkdir -p "$tools"
(
  flock 9
  build_helm
) 9>"$tools/.helm-build.lock"
build_kubernetes
link_tool coredns "$tools/coredns-$COREDNS_VERSION/coredns" build_coredns
# The shim and ctr are built with containerd; containerd is linked last, so a build cut short is redone.
for b in containerd-shim-runc-v2 ctr containerd; do
  link_tool "$b" "$tools/containerd-$CONTAINERD_VERSION/$b" build_containerd
done
echo "$bin"
