"""The node agent's hand-over when told to stop (deviceplugin.handover)."""

from __future__ import annotations

from deviceplugin.handover import LIMIT_SECONDS, SETTLE_SECONDS, hand_over


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[str] = []

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def withdraw(self) -> None:
        self.events.append(f"withdrawn at {self.now:.1f}")


def test_the_heartbeat_goes_first_then_the_agent_serves_until_the_pods_bound_here_are_allocated() -> None:
    clock = Clock()
    # Two pods bound here wait for their Allocate; the kubelet serves one at 4 s, the other at 5 s.
    left = hand_over(
        clock.withdraw,
        lambda: (clock.now < 4.0) + (clock.now < 5.0),
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert (left, clock.events) == (0, ["withdrawn at 0.0"])
    assert 5.0 <= clock.now < 5.0 + 0.5  # waited for the second, not for the limit


def test_the_settle_is_waited_even_with_nothing_bound_yet() -> None:
    # A bind the extender decided before it saw the heartbeat go lands during the settle.
    clock = Clock()
    assert hand_over(clock.withdraw, lambda: 0, sleep=clock.sleep, clock=lambda: clock.now) == 0
    assert clock.now == SETTLE_SECONDS


def test_a_pod_never_allocated_holds_the_stop_back_only_up_to_the_limit() -> None:
    clock = Clock()
    left = hand_over(clock.withdraw, lambda: 1, sleep=clock.sleep, clock=lambda: clock.now)
    assert left == 1
    assert SETTLE_SECONDS + LIMIT_SECONDS <= clock.now < SETTLE_SECONDS + LIMIT_SECONDS + 0.5


def test_an_api_that_refuses_the_withdrawal_does_not_hold_the_stop() -> None:
    clock = Clock()

    def refused() -> None:
        raise OSError("connection refused")

    assert hand_over(refused, lambda: 2, sleep=clock.sleep, clock=lambda: clock.now) == 2
    assert clock.now == 0.0
