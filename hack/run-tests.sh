#!/usr/bin/env bash
# The test run of `make test`, once `make test-deps` has built everything (the Makefile passes the DRA
# path's Kubernetes version, DRA_K8S_VERSION). Lanes run at once, because the sandbox tests mostly
# wait (on pods, processes, timers) and leave the cores idle:
#
#   two sandbox lanes, at normal priority, each bringing up one sandbox at a time (one sandbox fits a
#     host: its bridge and the kubelet's host paths are fixed):
#     the sandbox lane, on this host: the device plugin path's shared sandbox and its fleet of three;
#     the second sandbox lane, in a host of its own (sandbox.ownhost: network and mount namespaces of
#       its own, a cgroup subtree of its own): the device plugin path's lifecycle and chart tests,
#       then the DRA path's sandbox tests;
#   two more lanes, at nice 10, so that they take only what the sandbox lanes leave:
#     the other lane: the tests that need no cluster, in three worker processes as `make check` runs
#       them (valgrind's and Prometheus's too); then those that need a control plane (each its own,
#       on loopback ports) or look into the images (buildah, and a containerd of their own), in two;
#     the newest lane: the DRA path's control-plane tests, then the device plugin path on the newest
#       Kubernetes (the node agent's integration tests against its kube-apiserver, the extender
#       behind its kube-scheduler).
#
# When both are done, the tests that hold GPU time shares on the wall clock run beside the sandbox
# lanes, favoured (nice -15, in a CPU cgroup of the most weight); when the sandbox lanes are done
# too, the tests that hold host latencies to tight bounds, favoured, with the machine to themselves.
#
# Every step runs even when an earlier one failed; the exit status is the first failure's. The output
# of the sandbox lanes and the newest lane goes to build/test-logs/LANE.log, printed when the lane
# ends; a sandbox that saw a test fail keeps its logs under build/test-logs/sandboxes.
set -uo pipefail
cd "$(dirname "$0")/.."

usage="usage: hack/run-tests.sh DRA_K8S_VERSION"
logs=build/test-logs
pytest=.venv/bin/pytest
python=.venv/bin/python
# The device plugin path's sandbox tests that the second sandbox lane runs: each brings up sandboxes
# of its own, none the shared one or the fleet.
second_lane_tests=(tests/sandbox/test_lifecycle.py tests/sandbox/test_chart_lifecycle.py)

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

# A lane, run by this script itself: `hack/run-tests.sh --lane sandbox|second-sandbox|other|newest
# DRA_K8S_VERSION`.
if [ "${1:-}" = --lane ]; then
  dra_version="${3:?$usage}"
  case "$2" in
    sandbox)
      run $pytest --ignore=tests/draplugin "${second_lane_tests[@]/#/--ignore=}" -m sandbox
      ;;
    second-sandbox)
      run $pytest "${second_lane_tests[@]}" -m sandbox
      run dra_tests -m sandbox
      ;;
    other)
      run $pytest --ignore=tests/draplugin -m "not sandbox and not k8s and not images and not alone and not wallclock" \
        --numprocesses=3 --dist=loadfile
      run $pytest --ignore=tests/draplugin -m "(k8s or images) and not sandbox" --numprocesses=2 --dist=loadfile
      ;;
    newest)
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
# The favoured tests' CPU cgroup. Nice ranks a process only among the tasks of its own cgroup, and
# the sandboxes' pods run in cgroups of their own, each weighed as a whole against it: so those
# tests run at nice -15 in a cgroup of the most weight (cgroup v1's cpu.shares, v2's cpu.weight).
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  favoured_cgroup=/sys/fs/cgroup/tessera-favoured-tests weight_file=cpu.weight weight=10000
  echo +cpu >/sys/fs/cgroup/cgroup.subtree_control || echo "run-tests: no cpu controller for $favoured_cgroup" >&2
else
  favoured_cgroup=/sys/fs/cgroup/cpu/tessera-favoured-tests weight_file=cpu.shares weight=262144
fi
mkdir -p "$favoured_cgroup" && echo "$weight" >"$favoured_cgroup/$weight_file"
# shellcheck disable=SC2016 # $$ and $@ are the inner shell's
favoured=(nice -n -15 sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$favoured_cgroup")
# Everything runs in sessions of its own, in the background, so that the EXIT trap stops the whole
# of each (pytest and its clusters) when the run ends early: a failure here, Ctrl-C, CI's timeout. A
# signal ends `wait` at once (it would wait for a foreground command first).
sessions=()
start() {
  setsid "$@" &
  sessions+=("$!")
}
running() {
  local s
  for s in "${sessions[@]}"; do kill -0 -- -"$s" 2>/dev/null && return 0; done
  return 1
}
finish() {
  for s in "${sessions[@]}"; do kill -- -"$s" 2>/dev/null; done
  # A lane's tests bring their sandboxes down on the signal: the kernel settings go back once they are
  # gone (two minutes at most), or a `down` after it would write the kubelet's again.
  for _ in $(seq 120); do running || break; sleep 1; done
  for setting in "${sysctls_before[@]}"; do echo "${setting#*=}" >"/proc/sys/${setting%%=*}"; done
  rmdir "$favoured_cgroup" 2>/dev/null
  rm -rf build/hosts
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# A lane whose output goes to its log: NAME COMMAND...; its PID in lanes[NAME].
declare -A lanes
start_logged() {
  local name=$1
  shift
  start "$@" >"$logs/$name.log" 2>&1
  lanes[$name]=$!
}
start_logged sandbox "$0" --lane sandbox "$dra_version"
start_logged second-sandbox $python -m sandbox.ownhost second build/hosts/second "$0" --lane second-sandbox "$dra_version"
echo "run-tests: the sandbox lanes run beside this one (logs: $logs/sandbox.log, $logs/second-sandbox.log)" >&2

# Each logged lane's end: its status (the run's, when it is the first failure), then its output.
ended() {
  wait "${lanes[$1]}"
  local lane_status=$?
  echo "run-tests: the $1 lane ended ($lane_status); its output:" >&2
  cat "$logs/$1.log"
  [ "$status" -ne 0 ] || status=$lane_status
}
start_logged newest nice -n 10 "$0" --lane newest "$dra_version"
start nice -n 10 "$0" --lane other "$dra_version"
run wait "$!"
ended newest
# The tests that hold GPU time shares measured on the wall clock, once those lanes are done, beside
# the sandbox lanes: favoured, so that their processes wait on the lanes' for a CPU as little as
# may be. A client whose launches wait for a CPU falls short of its share, whatever the hook does (at
# nice -15 alone beside two sandbox lanes, an idle GPU's 75% measured 71.6%; docs/benchmarks.md,
# "Seeded roots, two sandbox lanes").
start "${favoured[@]}" $pytest -m wallclock
run wait "$!"
ended sandbox
ended second-sandbox
# Last, with the machine to itself, the tests that hold host latencies to tight bounds: even favoured,
# beside both sandbox lanes a service's p90 under MPS went from 0.42 ms to 1.58 ms, where wakeups
# waited for a CPU, not for the GPU (they take 2 minutes and little CPU).
start "${favoured[@]}" $pytest -m alone
run wait "$!"
# A sandbox torn down after a failed test left its logs (tests/sandbox/conftest.py, keep_logs).
if [ -d "$logs/sandboxes" ]; then
  echo "run-tests: the logs of sandboxes that saw a test fail: $(ls -d "$logs"/sandboxes/*)" >&2
fi
exit "$status"
