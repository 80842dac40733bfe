#!/usr/bin/env bash
# The test run of `make test`, once `make test-deps` has built everything (the Makefile passes the DRA
# path's Kubernetes version, DRA_K8S_VERSION). Four lanes run at once, because the sandbox tests
# mostly wait (on pods, processes, timers) and leave the CPUs idle:
#
#   three sandbox lanes, at normal priority, each bringing up one sandbox at a time (one sandbox fits
#     a host: its bridge and the kubelet's host paths are fixed), two of them in a host of their own
#     (sandbox.ownhost: network and mount namespaces of their own, a cgroup subtree of their own):
#     the device plugin path's sandbox tests on one node (the sandbox lane, on this host), those on
#     the three-node fleet (marker `fleet`, in host "fleet"), and the DRA path's (in host "dra");
#   the other lane, at nice 10, so that it takes only what the sandbox lanes leave: the tests that
#     need no cluster, in three worker processes as `make check` runs them (valgrind's and
#     Prometheus's too); those that need a control plane (each its own, on loopback ports) or look
#     into the images (buildah, and a containerd of their own), in two;
#     then the DRA path's control-plane tests, and the device plugin path on the newest Kubernetes
#     (the node agent's integration tests against its kube-apiserver, the extender behind its
#     kube-scheduler).
#
# Before the other lane, the tests that hold host latencies to tight bounds, then those that hold GPU
# time shares measured on the wall clock, run beside the sandbox lanes at a high CPU priority.
#
# Every step runs even when an earlier one failed; the exit status is the first failure's. The
# sandbox lanes' output goes to build/test-logs/LANE.log, printed when each lane ends.
set -uo pipefail
cd "$(dirname "$0")/.."

usage="usage: hack/run-tests.sh DRA_K8S_VERSION"
python=.venv/bin/python
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
      run $pytest --ignore=tests/draplugin -m "sandbox and not fleet"
      ;;
    fleet)
      run $pytest --ignore=tests/draplugin -m "sandbox and fleet"
      ;;
    dra-sandbox)
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
# The kernel settings each kubelet writes when it starts (sandbox.host.KUBELET_SYSCTLS), written once
# for the whole run and put back after it: they are the machine's, shared by the sandbox lanes, and
# a kubelet of one lane starting between the other's `up` and its check after `down` would
# otherwise change them under it.
kubelet_sysctls=()
while IFS= read -r setting; do kubelet_sysctls+=("$setting"); done < <(
  $python -c 'from sandbox.host import KUBELET_SYSCTLS as s; print("\n".join(f"{k}={v}" for k, v in s.items()))'
)
sysctls_before=()
for setting in "${kubelet_sysctls[@]}"; do
  key="${setting%%=*}"
  sysctls_before+=("$key=$(cat "/proc/sys/$key")")
  echo "${setting#*=}" >"/proc/sys/$key"
done
# Everything runs in sessions of its own, in the background, so that the EXIT trap stops the whole
# of each (pytest and its clusters) when the run ends early: a failure here, Ctrl-C, CI's timeout. A
# signal ends `wait` at once (it would wait for a foreground command first).
sessions=()
start() {
  setsid "$@" &
  sessions+=("$!")
}
finish() {
  for s in "${sessions[@]}"; do kill -- -"$s" 2>/dev/null; done
  for setting in "${sysctls_before[@]}"; do echo "${setting#*=}" >"/proc/sys/${setting%%=*}"; done
  rm -rf build/hosts
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# A sandbox lane: LANE [HOST], HOST naming the host of its own it runs in; its PID in lanes[LANE].
declare -A lanes
start_lane() {
  local lane=$1 host=${2:-}
  if [ -n "$host" ]; then
    start $python -m sandbox.ownhost "$host" "build/hosts/$host" "$0" --lane "$lane" "$dra_version"
  else
    start "$0" --lane "$lane" "$dra_version"
  fi >"$logs/$lane.log" 2>&1
  lanes[$lane]=$!
}
start_lane sandbox
start_lane fleet fleet
start_lane dra-sandbox dra
echo "run-tests: the sandbox lanes run beside this one (logs: $logs/LANE.log)" >&2

# First, beside the sandbox lanes only, at nice -15 so that their processes never wait on the lanes'
# for a CPU: the tests that hold host latencies to tight bounds (never beside other tests' workers),
# then those that hold GPU time shares measured on the wall clock (at nice 10 under the sandbox
# lanes they measured the share of a client whose launches waited for a CPU: 55% of the GPU's time
# for a 60% share at a load average of 20-27). Both sleep most of their time, so the sandbox lanes
# take the rest meanwhile; the other lane, which needs a CPU throughout, comes after them.
start nice -n -15 $pytest -m alone
run wait "$!"
start nice -n -15 $pytest -m wallclock --numprocesses=2 --dist=loadfile
run wait "$!"
start nice -n 10 "$0" --lane other "$dra_version"
run wait "$!"
# Each sandbox lane's end: its status, then its output.
for lane in sandbox fleet dra-sandbox; do
  wait "${lanes[$lane]}"
  lane_status=$?
  echo "run-tests: the $lane lane ended ($lane_status); its output:" >&2
  cat "$logs/$lane.log"
  [ "$status" -ne 0 ] || status=$lane_status
done
exit "$status"
