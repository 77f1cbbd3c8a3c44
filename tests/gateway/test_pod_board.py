"""The page a gateway pod's workers share (pod_board.py), on a real memfd: one reader at a time,
taken over when it lets go; what it publishes read whole or not at all; every worker's activity
seen by the reader, and the reader woken when an idle endpoint turns busy."""

from __future__ import annotations

import math
import os
import time

from llmendpoints_gateway.pod_board import Activity, PodBoard, slot_of


def test_one_reader_at_a_time_and_another_takes_over_when_it_lets_go() -> None:
    first = PodBoard.create(2)
    second = PodBoard(first.fd, 2, first.wake_fd)  # another worker: its own file description
    assert first.try_lead() and first.leading
    assert not second.try_lead() and not second.leading
    assert first.try_lead()  # still the reader
    first.close()  # its process ended: the kernel drops the lock
    assert second.try_lead() and second.leading


def test_a_follower_reads_each_publication_once_and_never_a_half_written_one() -> None:
    reader = PodBoard.create(2)
    follower = PodBoard(reader.fd, 2, reader.wake_fd)
    assert follower.read(0) == (0, None)  # nothing published yet
    reader.publish(b'{"a": 1}')
    seq, blob = follower.read(0)
    assert blob == b'{"a": 1}' and seq == 2
    assert follower.read(seq) == (seq, None)  # nothing new
    reader.publish(b"[2]")
    seq, blob = follower.read(seq)
    assert blob == b"[2]"
    # Caught mid-write (an odd sequence number): skipped, read at the next look.
    import struct

    struct.pack_into("Q", reader._map, 0, seq + 1)
    assert follower.read(seq) == (seq, None)


def test_the_reader_sees_every_workers_activity_and_is_woken_from_idle() -> None:
    board = PodBoard.create(3)
    reader, other = board.activity(0, grace=60.0), board.activity(2, grace=60.0)
    slot = slot_of("default/chat")
    now = time.monotonic()
    assert not reader.active(slot, now)
    woken: list[int] = []
    other.on_busy.append(lambda: woken.append(1))
    other.busy(slot)  # a request of the endpoint in worker 2
    assert reader.active(slot, now) and woken == [1]
    assert os.eventfd_read(board.wake_fd) >= 1  # the reader's wake-up, across processes
    other.busy(slot)  # already busy: nothing
    other.idle(slot, now)
    assert reader.active(slot, now + 59.0)  # within the grace
    assert not reader.active(slot, now + 61.0)
    other.busy(slot)  # idle for less than the grace: the reader is still reading it
    assert woken == [1]
    assert other._mine[slot] == math.inf


def test_one_process_alone_has_its_own_slots_and_wake_up() -> None:
    activity = Activity.private(grace=1.0)
    slot = slot_of("default/x")
    activity.busy(slot)
    assert activity.locally_active(time.monotonic())
    activity.drain_wake()
    activity.drain_wake()  # nothing to read: no error
