#!/usr/bin/env bash
# The test run of `make test`, once `make test-deps` has built everything (the Makefile passes the DRA
# path's Kubernetes version, DRA_K8S_VERSION). Two lanes run at once, because the sandbox tests mostly
# wait (on pods, processes, timers) and leave a core idle:
#
#   the sandbox lane, at normal priority (the longest, so it sets the run's time): the tests that bring
#     up a sandbox, one at a time (one sandbox fits a host: its bridge and the kubelet's host paths
#     are fixed), then the DRA path's sandbox tests;
#   the other lane, at nice 10, so that it takes only what the sandbox lane leaves: the tests that
#     need no cluster, in three worker processes as `make check` runs them (valgrind's and
#     Prometheus's too); those that need a control plane (each its own, on loopback ports) or look
#     into the images (buildah, and a containerd of their own), in two;
#     then the DRA path's control-plane tests, and the device plugin path on the newest Kubernetes
#     (the node agent's integration tests against its kube-apiserver, the extender behind its
#     kube-scheduler).
#
# When the other lane is done, the tests that hold host latencies to tight bounds, then those that
# hold GPU time shares on the wall clock, run beside the sandbox lane at a high CPU priority.
#
# Every step runs even when an earlier one failed; the exit status is the first failure's. The
# sandbox lane's output goes to build/test-logs/sandbox.log, printed when the lane ends; a sandbox
# that saw a test fail keeps its logs under build/test-logs/sandboxes.
set -uo pipefail
cd "$(dirname "$0")/.."

usage="usage: hack/run-tests.sh DRA_K8S_VERSION"
logs=build/test-logs
pytest=.venv/bin/pytest

status=0
run() {
  "$@"
  local rc=$?
  [ "$status" -ne 0 ] || status=$rc
}

# The DRA path's Kubernetes bin directory (`make test-deps` built it).
dra_bin() {
  K8S_VERSION="$dra_version" hack/k8s-binaries.sh
}

dra_tests() {
  dra_bin >/dev/null && $pytest tests/draplugin "$@"
}

newest_device_plugin_tests() {
  local bin
  bin="$(dra_bin)" && TESSERA_K8S_BIN="$bin" $pytest tests/deviceplugin/test_plugin.py tests/extender/test_k8s.py
}

# A lane, run by this script itself: `hack/run-tests.sh --lane sandbox|other DRA_K8S_VERSION`.
if [ "${1:-}" = --lane ]; then
  dra_version="${3:?$usage}"
  case "$2" in
    sandbox)
      run $pytest --ignore=tests/draplugin -m sandbox
      run dra_tests -m sandbox
      ;;
    other)
      run $pytest --ignore=tests/draplugin -m "not sandbox and not k8s and not images and not alone and not wallclock" \
        --numprocesses=3 --dist=loadfile
      run $pytest --ignore=tests/draplugin -m "(k8s or images) and not sandbox" --numprocesses=2 --dist=loadfile
      run dra_tests -m "not sandbox"
      run newest_device_plugin_tests
      ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  exit "$status"
fi

dra_version="${1:?$usage}"
mkdir -p "$logs"
rm -rf "$logs/sandboxes"  # an earlier run's
# Everything runs in sessions of its own, in the background, so that the EXIT trap stops the whole
# of each (pytest and its clusters) when the run ends early: a failure here, Ctrl-C, CI's timeout. A
# signal ends `wait` at once (it would wait for a foreground command first).
sessions=()
start() {
  setsid "$@" &
  sessions+=("$!")
}
trap 'for s in "${sessions[@]}"; do kill -- -"$s" 2>/dev/null; done' EXIT
trap 'exit 143' TERM INT HUP

start "$0" --lane sandbox "$dra_version" >"$logs/sandbox.log" 2>&1
sandbox=$!
echo "run-tests: the sandbox lane runs beside this one (log: $logs/sandbox.log)" >&2

start nice -n 10 "$0" --lane other "$dra_version"
run wait "$!"
# The tests that hold host latencies to tight bounds, once the other lane is done: beside the sandbox
# lane, which mostly waits, at nice -15, so that its processes never wait on the lane's (they sleep
# most of their time and take little CPU).
start nice -n -15 $pytest -m alone
run wait "$!"
# Then, the same way, the tests that hold GPU time shares measured on the wall clock: a client whose
# launches wait for a CPU falls short of its share, whatever the hook does (at nice 10 beside more
# sandboxes, a 60% share measured 54.7%; docs/benchmarks.md, "Sandboxes side by side").
start nice -n -15 $pytest -m wallclock
run wait "$!"
wait "$sandbox"
sandbox_status=$?
echo "run-tests: the sandbox lane ended ($sandbox_status); its output:" >&2
cat "$logs/sandbox.log"
# A sandbox torn down after a failed test left its logs (tests/sandbox/conftest.py, keep_logs).
if [ -d "$logs/sandboxes" ]; then
  echo "run-tests: the logs of sandboxes that saw a test fail: $(ls -d "$logs"/sandboxes/*)" >&2
fi
[ "$status" -ne 0 ] || status=$sandbox_status
exit "$status"
