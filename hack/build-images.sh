#!/usr/bin/env bash
# Build Tessera's images with buildah, without a Docker daemon or a registry (`make images`):
#
#   1. the base image: an mmdebstrap of Debian bookworm with python3 in a venv whose python3 and pip
#      come first on PATH (what python:3.11-slim gives the Dockerfile), committed into buildah's
#      storage as localhost/tessera-base:bookworm and rebuilt only when its recipe below changes;
#   2. the product image from the repository's Dockerfile, unchanged for Docker users: only
#      --build-arg BASE_IMAGE points at the local base instead of the public python:3.11-slim;
#   3. the chart's scheduler image (registry.k8s.io/kube-scheduler:<pinned>) from the kube-scheduler
#      that hack/k8s-binaries.sh builds (static: CGO_ENABLED=0), FROM scratch
#      (deploy/images/scheduler.Dockerfile), and the example of a user's workload image
#      (deploy/examples/python-workload/Dockerfile: NVIDIA's Python clients from PyPI, no Tessera code);
#   4. each image saved as an OCI archive under build/images/ (push it with `skopeo copy`, see
#      docs/install.md) and, when a sandbox's containerd answers, imported into it.
#
# Environment:
#   TESSERA_IMAGES_DIR    where the OCI archives go (default build/images)
#   TESSERA_BUILDAH_ROOT  a buildah storage directory of its own (default: buildah's, so `buildah images`
#                         lists the images); the tests and the cold-build measurement use a fresh one
#   TESSERA_SANDBOX_ROOT  the sandbox whose containerd gets the images (default /var/lib/tessera-sandbox;
#                         skipped when its containerd socket does not answer)
#   DEBIAN_MIRROR         the base image's Debian mirror (default http://deb.debian.org/debian)
#   BUILD_CA_BUNDLE       CA bundle mounted read-only over the build's system bundle during RUN steps
#                         (default: the host's /etc/ssl/certs/ca-certificates.crt); never in a layer
#
# Storage driver: overlay. Root on this kernel has native overlay (`buildah info` reports
# "Native Overlay Diff: true"), so layers are stored once and diffed natively; vfs would copy the whole
# root file system for every layer (several hundred MiB per step here). Isolation: chroot. It needs
# no daemon, no runc and no cgroup setup for RUN steps (this machine's cgroup v1 hybrid and the missing
# CAP_SYS_RESOURCE trip runc, see /work/shared/notes/container-runtime.md), and RUN steps share the
# host's network, which apt and pip need.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "build-images: $*" >&2; }
die() {
  log "$*"
  exit 1
}

for tool in buildah mmdebstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing: run hack/install-sandbox-deps.sh (root)"
done
[ "$(id -u)" -eq 0 ] || die "run as root (buildah's rootful overlay storage and mmdebstrap's root mode)"

out="${TESSERA_IMAGES_DIR:-build/images}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ca_bundle="${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
sandbox_root="${TESSERA_SANDBOX_ROOT:-/var/lib/tessera-sandbox}"
python="${PYTHON:-.venv/bin/python}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

version="$(sed -nE 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n1)"
[ -n "$version" ] || die "no version in pyproject.toml"
# The names the cluster asks for: the chart's image.repository:tag ("tessera:0.1.0") normalizes to
# docker.io/library/tessera:0.1.0; the chart's kube-scheduler tag follows the cluster's version
# (scheduler.image.tag empty), so the image is built for the Kubernetes that hack/k8s-binaries.sh pins.
product_image="docker.io/library/tessera:$version"
k8s_version="${K8S_VERSION:-$(sed -nE 's/^K8S_VERSION="\$\{K8S_VERSION:-(v[^}]+)\}"$/\1/p' hack/k8s-binaries.sh)}"
[ -n "$k8s_version" ] || die "no K8S_VERSION in hack/k8s-binaries.sh"
scheduler_image="registry.k8s.io/kube-scheduler:$k8s_version"
workload_image="docker.io/library/tessera-example-python:$version"
base_image="localhost/tessera-base:bookworm"

bh=(buildah --storage-driver overlay)
if [ -n "${TESSERA_BUILDAH_ROOT:-}" ]; then
  bh+=(--root "$TESSERA_BUILDAH_ROOT/root" --runroot "$TESSERA_BUILDAH_ROOT/run")
fi

# Working containers and temporary directories of this run, removed on any exit.
cleanup_containers=()
cleanup_dirs=()
cleanup() {
  local c d
  for c in "${cleanup_containers[@]}"; do "${bh[@]}" rm "$c" >/dev/null 2>&1 || true; done
  for d in "${cleanup_dirs[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT

# --------------------------------------------------------------------------------------------------
# 1. The base image. Its recipe is this function: the image is rebuilt when its text changes.

base_rootfs() {
  # minbase: Essential + apt (the Dockerfile's build stage apt-installs gcc and make). The venv is
  # python:3.11-slim's equivalent: a python3 and pip of its own, outside Debian's externally managed
  # system Python, so the Dockerfile's `pip install` works as it does there. Debian's pip trusts the
  # system CA bundle. Documentation and manual pages are left out, as in the slim images.
  mmdebstrap --variant=minbase --mode=root --format=tar \
    --include=python3,python3-venv,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='chroot "$1" python3 -m venv /opt/python' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$1" \
    "deb $mirror bookworm main" \
    "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main"
}

base_config() {
  "${bh[@]}" config \
    --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd python3 \
    --label "org.tessera.base-recipe=$1" \
    --created-by "hack/build-images.sh: mmdebstrap bookworm + python3 venv" \
    "$2"
}

build_base() {
  local recipe have tmp ctr mnt
  recipe="$(declare -f base_rootfs base_config | sha256sum | cut -c1-16)"
  have="$("${bh[@]}" inspect --type image --format '{{index .OCIv1.Config.Labels "org.tessera.base-recipe"}}' "$base_image" 2>/dev/null || true)"
  if [ "$have" = "$recipe" ]; then
    log "base $base_image is current (recipe $recipe)"
    return 0
  fi
  log "base $base_image: mmdebstrap bookworm (recipe $recipe)"
  tmp="$(mktemp -d)"
  cleanup_dirs+=("$tmp")
  base_rootfs "$tmp/rootfs.tar"
  ctr="$("${bh[@]}" from --name "tessera-base-build-$$" scratch)"
  cleanup_containers+=("$ctr")
  mnt="$("${bh[@]}" mount "$ctr")"
  # Extracted as root with numeric owners, modes and extended attributes as mmdebstrap wrote them.
  tar -x -C "$mnt" --numeric-owner --same-permissions --xattrs --xattrs-include='*' -f "$tmp/rootfs.tar"
  "${bh[@]}" umount "$ctr" >/dev/null
  base_config "$recipe" "$ctr"
  "${bh[@]}" commit --quiet --rm "$ctr" "$base_image" >/dev/null
  rm -f "$tmp/rootfs.tar"
}

# --------------------------------------------------------------------------------------------------
# 2, 3. The images. --layers keeps each step's layer, so an unchanged input rebuilds nothing.

bud() {
  local mounts=()
  if [ -f "$ca_bundle" ]; then
    mounts=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
  fi
  "${bh[@]}" bud --isolation chroot --layers --force-rm --pull-never "${mounts[@]}" "$@"
}

build_product() {
  log "product $product_image from Dockerfile (BASE_IMAGE=$base_image)"
  bud --build-arg "BASE_IMAGE=$base_image" -f Dockerfile -t "$product_image" .
}

build_scheduler() {
  local bin ctx got
  bin="$(hack/k8s-binaries.sh)/kube-scheduler"
  got="$("$bin" --version)"
  [ "$got" = "Kubernetes $k8s_version" ] || die "$bin reports '$got', the chart names $k8s_version"
  file -b "$bin" | grep -q 'statically linked' || die "$bin is not statically linked (FROM scratch needs it)"
  ctx="$out/scheduler-context"
  mkdir -p "$ctx"
  cmp -s "$bin" "$ctx/kube-scheduler" || cp "$bin" "$ctx/kube-scheduler"
  log "scheduler $scheduler_image from $bin"
  bud --build-arg "K8S_VERSION=$k8s_version" -f deploy/images/scheduler.Dockerfile -t "$scheduler_image" "$ctx"
}

build_workload() {
  log "workload example $workload_image (BASE_IMAGE=$base_image)"
  bud --build-arg "BASE_IMAGE=$base_image" -t "$workload_image" deploy/examples/python-workload
}

# --------------------------------------------------------------------------------------------------
# 4. OCI archives (rewritten only when the image changed) and the sandbox's containerd.

save() {
  local image="$1" archive="$out/$2" id
  id="$("${bh[@]}" inspect --type image --format '{{.FromImageID}}' "$image")"
  if [ -f "$archive" ] && [ "$(cat "$archive.id" 2>/dev/null)" = "$id" ]; then
    log "$archive is current"
    return 0
  fi
  rm -f "$archive" "$archive.id"
  # The reference name inside the archive is the full image name: `ctr images import` names the image
  # by it, and `skopeo copy oci-archive:...` reads the one image without naming it.
  "${bh[@]}" push --quiet "$image" "oci-archive:$archive.tmp.$$:$image" >/dev/null
  mv "$archive.tmp.$$" "$archive"
  echo "$id" >"$archive.id"
  log "saved $image -> $archive"
}

import_into_sandbox() {
  # The first node's containerd (sandbox.layout: <dir>/node); a further node's images are imported
  # when `up` makes it.
  [ -S "$sandbox_root/node/containerd/containerd.sock" ] || return 0
  [ -x "$python" ] || die "$python is missing (make's venv), needed to import into the sandbox"
  log "importing into the sandbox's containerd ($sandbox_root)"
  # The sandbox's own importer (ctr images import against its socket), not a second one.
  "$python" - "$sandbox_root" "$@" <<'EOF'
import socket
import sys
from pathlib import Path

from sandbox.containerd import import_images
from sandbox.layout import Layout

layout = Layout(Path(sys.argv[1]))
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    try:
        s.connect(str(layout.containerd_socket))
    except OSError:
        print("build-images: the sandbox's containerd does not answer; not imported", file=sys.stderr)
        sys.exit(0)
import_images(layout, {Path(p).name: Path(p) for p in sys.argv[2:]})
EOF
}

build_base
build_product
build_scheduler
build_workload
save "$product_image" tessera.tar
save "$scheduler_image" kube-scheduler.tar
save "$workload_image" tessera-example-python.tar
import_into_sandbox "$out/tessera.tar" "$out/kube-scheduler.tar" "$out/tessera-example-python.tar"
log "done: $product_image, $scheduler_image, $workload_image (OCI archives in $out)"
