# Sourced by the scripts that build from Go modules (hack/k8s-binaries.sh, hack/prometheus-binaries.sh):
# a Go toolchain new enough for them, installed from Debian packages only when missing or older.
# GOTOOLCHAIN=local: a Go older than a module's go directive fails loudly instead of downloading one.
# shellcheck shell=bash

GO_MIN_MINOR=24
export GOTOOLCHAIN=local

ensure_go() {
  if command -v go >/dev/null 2>&1; then
    local minor
    minor="$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')"
    if [ "${minor:-0}" -ge "$GO_MIN_MINOR" ]; then return 0; fi
    echo "go-env: go $(go env GOVERSION) is older than 1.$GO_MIN_MINOR" >&2
  fi
  echo "go-env: installing Go from Debian packages" >&2
  # `make test` builds these in parallel: one apt at a time (hack/install-sandbox-deps.sh takes the
  # same lock).
  flock /var/lock/tessera-apt.lock sh -c 'apt-get update -qq && apt-get install -y -qq golang-go >/dev/null'
}

ensure_go
