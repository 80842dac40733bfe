"""One node agent per node (nodeagent/nodelock.py): the other kind is refused with the holder named,
the same kind waits for the one before it (a rolling update), and a holder that dies lets go."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deviceplugin.main import main as device_plugin_main
from nodeagent.nodelock import AGENT_LOCK, AgentConflictError, holding_node


def test_the_other_kind_is_refused_naming_the_holder(tmp_path: Path) -> None:
    stop = threading.Event()
    with holding_node(tmp_path, "device plugin", stop) as held:
        assert held
        with (
            pytest.raises(
                AgentConflictError, match=r"held by the device plugin \(pod .+\); a node runs either"
            ),
            holding_node(tmp_path, "DRA driver", stop),
        ):
            pass
    with holding_node(tmp_path, "DRA driver", stop) as held:
        assert held  # free again once the first let go


def test_the_same_kind_waits_for_the_one_before_it(tmp_path: Path) -> None:
    stop = threading.Event()
    order: list[str] = []
    first_lets_go = threading.Event()

    def second() -> None:
        with holding_node(tmp_path, "DRA driver", stop, poll=0.01) as held:
            order.append(f"second held={held}")

    with holding_node(tmp_path, "DRA driver", stop) as held:
        assert held
        waiting = threading.Thread(target=second)
        waiting.start()
        first_lets_go.wait(0.2)
        order.append("first lets go")
    waiting.join(10)
    assert order == ["first lets go", "second held=True"]


def test_a_stop_while_waiting_starts_nothing(tmp_path: Path) -> None:
    stop = threading.Event()
    with holding_node(tmp_path, "device plugin", threading.Event()):
        stop.set()
        with holding_node(tmp_path, "device plugin", stop, poll=0.01) as held:
            assert not held


def test_a_holder_that_dies_lets_go(tmp_path: Path) -> None:
    script = (
        "import sys, threading, time\n"
        "from pathlib import Path\n"
        "from nodeagent.nodelock import holding_node\n"
        "with holding_node(Path(sys.argv[1]), 'device plugin', threading.Event()):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(AgentConflictError), holding_node(tmp_path, "DRA driver", threading.Event()):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with holding_node(tmp_path, "DRA driver", threading.Event()) as held:
        assert held
    assert "DRA driver" in (tmp_path / AGENT_LOCK).read_text()


def test_the_device_plugin_exits_2_where_the_dra_driver_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The binary's way out: the error logged, exit status 2, nothing served."""
    state = tmp_path / "state"
    # main() installs its own SIGTERM and SIGINT handlers: pytest's are put back after it.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with holding_node(state, "DRA driver", threading.Event()):
            status = device_plugin_main(
                ["--node-name=n1", f"--state-dir={state}", "--kubeconfig=/nonexistent"]
            )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status == 2
    assert "held by the DRA driver" in caplog.text
    assert [p.name for p in state.iterdir()] == [AGENT_LOCK]
