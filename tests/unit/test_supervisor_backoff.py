"""The supervisor's restart rules, without processes: the backoff schedule, the pinned port, and
what one look at a (fake) stack announces and restarts on a fake clock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from pdd.testbed.launcher import pinned_args
from pdd.testbed.stack import StackConfig
from pdd.testbed.supervisor import Backoff, Supervisor


def test_backoff_doubles_from_half_a_second_to_ten():
    b = Backoff()
    assert [b.delay(n) for n in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert b.delay(10_000) == 10.0  # no overflow for a service that never comes back


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"base_s": 0}, "base_s"),
        ({"max_s": 0.1}, "max_s"),
        ({"reset_after_s": -1}, "reset_after_s"),
    ],
)
def test_backoff_refuses_nonsense(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        Backoff(**kwargs)
    with pytest.raises(ValueError, match="failures"):
        Backoff().delay(-1)


def test_restart_policy_is_validated_and_off_by_default():
    assert StackConfig(model="tiny:7").restart == "no"
    assert StackConfig(model="tiny:7", restart="on-failure").restart == "on-failure"
    with pytest.raises(ValueError, match="restart"):
        StackConfig(model="tiny:7", restart="always")


def test_a_restart_pins_the_port_it_had():
    args = ("--port", "0", "--kvstore", "127.0.0.1:9", "--port", "4321", "--log-format", "json")
    assert pinned_args("services.main_decode", args, "127.0.0.1:4321") == [
        "--port",
        "4321",
        "--kvstore",
        "127.0.0.1:9",
        "--port",
        "4321",
        "--log-format",
        "json",
    ]
    wan = ("--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:5000")
    assert pinned_args("services.wan_link", wan, "127.0.0.1:6000") == [
        "--listen",
        "127.0.0.1:6000",
        "--upstream",
        "127.0.0.1:5000",
    ]


class _Proc:
    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class _Process:
    name: str
    address: str = "127.0.0.1:1"
    proc: _Proc = field(default_factory=_Proc)

    def alive(self) -> bool:
        return self.proc.returncode is None


class _Stack:
    def __init__(self) -> None:
        self.processes = [_Process("kvstore"), _Process("main_decode-0")]
        self.redis = None
        self.restarted: list[str] = []

    def restart(self, name: str) -> None:
        i = next(i for i, p in enumerate(self.processes) if p.name == name)
        self.processes[i] = _Process(name, address="")  # listening comes later
        self.restarted.append(name)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervisor():
    stack, clock, lines = _Stack(), _Clock(), []
    return stack, clock, lines, Supervisor(stack, say=lines.append, clock=clock)


def test_a_death_is_announced_restarted_after_its_backoff_and_announced_again():
    stack, clock, lines, sup = _supervisor()
    sup.step()
    stack.processes[1].proc.returncode = -9
    clock.now += 1
    sup.step()
    assert lines == ["main_decode-0 exited (code -9); restarting in 0.5 s"]
    clock.now += 0.4
    sup.step()
    assert stack.restarted == []  # still backing off
    clock.now += 0.2
    sup.step()
    assert stack.restarted == ["main_decode-0"]
    sup.step()
    assert len(lines) == 1  # not listening yet
    stack.processes[1].address = "127.0.0.1:1"
    sup.step()
    assert lines[-1] == "main_decode-0 restarted (127.0.0.1:1)"
    assert stack.processes[0].alive()  # the rest was never touched


def test_quick_deaths_back_off_longer_and_a_long_life_resets_the_count():
    stack, clock, lines, sup = _supervisor()
    sup.step()
    for expected in ("0.5", "1", "2"):
        stack.processes[1].proc.returncode = 1
        sup.step()
        assert lines[-1] == f"main_decode-0 exited (code 1); restarting in {expected} s"
        clock.now += 10.0
        sup.step()
    clock.now += 31.0  # up for longer than reset_after_s
    stack.processes[1].proc.returncode = 1
    sup.step()
    assert lines[-1] == "main_decode-0 exited (code 1); restarting in 0.5 s"


def test_a_clean_exit_or_a_stopping_stack_is_not_restarted():
    stack, clock, lines, sup = _supervisor()
    stack.processes[0].proc.returncode = 0
    sup.step()
    clock.now += 60
    sup.step()
    assert lines == ["kvstore exited (code 0); not restarted"] and stack.restarted == []
    stop = threading.Event()
    stop.set()
    stack.processes[1].proc.returncode = -15
    sup.step(stop)
    assert len(lines) == 1 and stack.restarted == []
