"""The group's liveness channel (group.py): the leader and its workers know at once when the
other end's process is gone, and after LLMEP_GROUP_TIMEOUT_SECONDS when it is silent. Real
sockets on loopback; the bookkeeping (Members) is pure."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from llmendpoints_runtime.group import LeaderChannel, Members, WorkerChannel, decode, encode
from ports import free_port


def test_lines_round_trip_and_cannot_be_split():
    assert decode(encode("BEAT", "ready")) == ("BEAT", "ready")
    assert decode(encode("STOP", "a\nb")) == ("STOP", "a b")
    assert decode(b"") == ("", "")
    assert len(encode("STOP", "x" * 10_000)) <= 512


def test_members_join_once_and_fall_silent():
    members = Members(3)
    assert members.hello(1, now=0.0) is None
    assert not members.complete
    assert "outside this group" in (members.hello(3, now=0.0) or "")
    assert members.hello(2, now=1.0) is None and members.complete
    # A second HELLO for a rank is turned away: it is not that worker's (its loss is the end
    # of the first connection), and a stranger cannot take the group down by saying it.
    assert "joined already" in (members.hello(1, now=2.0) or "")
    members.heard(1, now=10.0)
    assert members.silent(now=11.5, timeout=10.0) == ("worker 2 sent nothing for 10 s (node lost?)")
    assert members.silent(now=10.5, timeout=10.0) is None


class Lost:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()

    def wait(self, timeout: float = 10.0) -> str:
        assert self.event.wait(timeout), "no loss reported"
        return self.reasons[0]


def _group(timeout: float = 5.0, state: str = "initializing"):
    port = free_port()
    leader_lost, worker_lost = Lost(), Lost()
    leader = LeaderChannel(
        "127.0.0.1", port, 2, timeout=timeout, on_lost=leader_lost, state=lambda: state
    )
    leader.start()
    worker = WorkerChannel("127.0.0.1", port, 1, timeout=timeout, on_lost=worker_lost)
    worker.start()
    deadline = time.monotonic() + 10
    while not (leader.members.complete and worker.leader_state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leader.members.complete and worker.leader_state == state
    return leader, worker, leader_lost, worker_lost


def test_a_worker_that_stops_is_known_to_the_leader_at_once_with_its_reason():
    leader, worker, leader_lost, worker_lost = _group()
    worker.stop("the engine's workers exited (status 1)")
    assert leader_lost.wait() == "worker 1 stopped: the engine's workers exited (status 1)"
    assert not worker_lost.reasons
    leader.stop()


def test_a_leader_that_stops_takes_its_workers_down():
    leader, worker, _, worker_lost = _group(state="ready")
    leader.stop("the group lost a node: worker 2 is gone")
    assert "the leader stopped the group: the group lost a node" in worker_lost.wait()
    worker.stop()


def _leader_and_raw_worker(timeout: float) -> tuple[LeaderChannel, Lost, socket.socket]:
    """A leader and a connection that said HELLO as worker 1, and nothing since."""
    lost = Lost()
    leader = LeaderChannel("127.0.0.1", free_port(), 2, timeout=timeout, on_lost=lost)
    leader.start()
    raw = socket.create_connection(("127.0.0.1", leader.port))
    raw.sendall(encode("HELLO", "1"))
    deadline = time.monotonic() + 5
    while not leader.members.complete and time.monotonic() < deadline:
        time.sleep(0.02)
    return leader, lost, raw


def test_a_connection_closed_without_a_word_is_a_lost_member():
    leader, lost, raw = _leader_and_raw_worker(timeout=5.0)
    raw.close()  # a worker killed by SIGKILL
    # Closed, or reset (the leader's beats were never read): gone either way.
    assert lost.wait().startswith("worker 1 is gone (its connection ")
    leader.stop()


def test_a_silent_worker_is_lost_after_the_timeout():
    leader, lost, raw = _leader_and_raw_worker(timeout=1.0)  # a node that vanished
    assert "worker 1 sent nothing for 1 s" in lost.wait()
    raw.close()
    leader.stop()


def test_a_stranger_on_the_port_is_ignored():
    leader, worker, leader_lost, _ = _group()
    for line in (b"GET / HTTP/1.1\r\n\r\n", encode("HELLO", "1"), encode("HELLO", "7")):
        with socket.create_connection(("127.0.0.1", leader.port)) as raw:
            raw.sendall(line)
    time.sleep(0.5)
    assert not leader_lost.reasons
    worker.stop()
    leader.stop()


def test_a_port_in_use_is_an_error_at_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        leader = LeaderChannel(
            "127.0.0.1", taken.getsockname()[1], 2, timeout=5.0, on_lost=lambda _r: None
        )
        with pytest.raises(OSError):
            leader.start()
