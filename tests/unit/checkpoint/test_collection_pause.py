"""Automatic garbage collection paused while a save plans: off inside, back as it was after (also after
an error, when pauses of two threads overlap, and when the loop runs with it off), and on again in a
child forked during a pause. (Its effect on the loop: ``benchmarks/gc_stall.py``.)"""

from __future__ import annotations

import gc
import os
import threading

import pytest

from trainguard.checkpoint.collection_pause import collections_paused


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_off_inside_and_on_again_after():
    with collections_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_on_again_after_an_error_inside():
    with pytest.raises(RuntimeError), collections_paused():
        raise RuntimeError("a failed save")
    assert gc.isenabled()


def test_a_loop_that_collects_by_hand_keeps_it_off():
    gc.disable()
    with collections_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_turn_it_on_only_when_the_last_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second() -> None:
        first_in.wait()
        with collections_paused():
            second_in.set()
            first_out.wait()
            seen["after the first ended"] = gc.isenabled()
        seen["after both"] = gc.isenabled()

    thread = threading.Thread(target=second)
    thread.start()
    with collections_paused():
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert seen == {"after the first ended": False, "after both": True}


def test_a_child_forked_during_a_pause_collects_automatically():
    read, write = os.pipe()
    with collections_paused():
        pid = os.fork()
        if pid == 0:
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
    os.close(write)  # a child that wrote nothing reads as b"", not as a wait for ever
    assert os.read(read, 1) == b"1"
    os.close(read)
