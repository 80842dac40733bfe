#!/usr/bin/env bash
# The test run of `make test`, once `make test-deps` has built everything but the DRA path's
# Kubernetes (the Makefile passes its version, DRA_K8S_VERSION):
#
#   1. every test that does not need that Kubernetes, while it builds in the background at the lowest
#      CPU and I/O priority: those tests leave about a core idle (they wait on pods, processes and
#      timers), and nice 19 gives the build only what they leave. Cold, that takes a whole
#      Kubernetes build off the critical path; warm, the build finds its binaries and is done. First
#      the tests that need no cluster (`make check`'s, and valgrind's and Prometheus's) in four
#      worker processes, as `make check` runs them; then those that need a control plane, a sandbox
#      or the images, or must run alone, one at a time: one control plane serves them all, and one
#      sandbox at a time fits the host.
#   2. the DRA path's tests (tests/draplugin), once the build is done;
#   3. the device plugin path on the newest Kubernetes too: the node agent's integration tests
#      against its kube-apiserver, and the extender behind its kube-scheduler.
#
# Every step runs even when an earlier one failed; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

dra_version="${1:?usage: hack/run-tests.sh DRA_K8S_VERSION}"
log=build/k8s-binaries-dra.log
mkdir -p build
# Its own session, so that the trap stops the whole build (the script, go, the compilers) when the
# run ends early: a failure here, Ctrl-C, CI's timeout.
setsid nice -n 19 ionice -c 3 env K8S_VERSION="$dra_version" hack/k8s-binaries.sh >"$log" 2>&1 &
build=$!
trap 'kill -- -"$build" 2>/dev/null' EXIT

status=0
run() {
  "$@"
  local rc=$?
  [ "$status" -ne 0 ] || status=$rc
}

run .venv/bin/pytest --ignore=tests/draplugin -m "not sandbox and not k8s and not images and not alone" \
  --numprocesses=4 --dist=loadfile
run .venv/bin/pytest --ignore=tests/draplugin -m "sandbox or k8s or images or alone"
echo "run-tests: waiting for Kubernetes $dra_version (log: $log)" >&2
if ! wait "$build"; then
  echo "run-tests: building Kubernetes $dra_version failed:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
bin="$(K8S_VERSION="$dra_version" hack/k8s-binaries.sh)"
run .venv/bin/pytest tests/draplugin
run env TESSERA_K8S_BIN="$bin" .venv/bin/pytest tests/deviceplugin/test_plugin.py tests/extender/test_k8s.py
exit "$status"
