#!/usr/bin/env bash
# Install what `tessera sandbox` needs from Debian, only when missing:
#   containerd + runc        the container runtime the kubelet talks CRI to
#   containernetworking-plugins   bridge/host-local/loopback CNI plugins (in /usr/lib/cni)
#   busybox-static           the one binary the project's own OCI images are built from
#   iptables, iproute2       used by the CNI bridge plugin and by `sandbox down` to remove devices
#   buildah, mmdebstrap      `make images` without a Docker daemon: the Dockerfile built by buildah
#                            (rootful, overlay storage; uidmap comes as its dependency) on a bookworm
#                            base made by mmdebstrap (hack/build-images.sh)
#   skopeo                   copies the saved OCI archives to a registry (docs/install.md)
#   file                     hack/build-images.sh checks that kube-scheduler is statically linked
#   clang, libclang-rt-dev   the hook's fuzzers (libFuzzer with ASan/UBSan: make -C hook fuzz,
#                            tests/hook/test_fuzz.py)
#   valgrind                 callgrind: the hook's instructions per call (bench/hook_callgrind.py,
#                            tests/hook/test_instruction_budget.py)
# Must run as root (apt). Safe to run again: it installs nothing when everything is present.
set -euo pipefail

packages=(containerd runc containernetworking-plugins busybox-static iptables iproute2 buildah mmdebstrap skopeo file clang libclang-rt-dev valgrind)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-sandbox-deps: all present (${packages[*]})" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-sandbox-deps: missing ${missing[*]}; run this script as root to install them" >&2
  exit 1
fi
echo "install-sandbox-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# `make test` builds in parallel: one apt at a time (hack/go-env.sh takes the same lock).
exec 9>/var/lock/tessera-apt.lock
flock 9
apt-get update -qq
# --no-install-recommends: no docker/criu extras; policy-rc.d keeps Debian from starting the system
# containerd service, since the sandbox runs its own containerd with its own root and socket.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-sandbox-deps: done" >&2
