"""Stacking a batch in parallel chunks: the same array as np.stack, errors raised, no chunk left
writing after a failure."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from clipserve.backends.stacking import (
    CHUNK_BYTES,
    MAX_THREADS,
    stack,
    stack_into,
    threads_for,
)
from clipserve.config import resolve_workers

IMAGE = (224, 224, 3)  # 150 KB: 256 of them are ~38 MB, well over one chunk


def images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, IMAGE, dtype=np.uint8) for _ in range(n)]


def test_threads_follow_the_bytes_the_cores_and_the_cap() -> None:
    assert threads_for(0, 16) == 1
    assert threads_for(CHUNK_BYTES - 1, 16) == 1
    assert threads_for(2 * CHUNK_BYTES, 16) == 2
    assert threads_for(100 * CHUNK_BYTES, 16) == MAX_THREADS
    assert threads_for(100 * CHUNK_BYTES, 1) == 1  # a server pinned to one core


@pytest.mark.parametrize("n", [1, 3, 27, 28, 64, 255, 256])
def test_equals_np_stack_at_every_size(n: int) -> None:
    arrays = images(n, seed=n)
    expected = np.stack(arrays)
    np.testing.assert_array_equal(stack(arrays), expected)
    out = np.zeros((300, *IMAGE), np.uint8)
    got = stack_into(arrays, out)
    assert got.base is out or got is out or np.shares_memory(got, out)
    np.testing.assert_array_equal(got, expected)
    assert not out[n:].any()  # nothing written past the batch


def test_large_batches_are_copied_on_more_than_one_thread() -> None:
    if not parallel_here():
        pytest.skip("one usable core: one thread by design")
    seen: set[str] = set()

    class Recorded(np.ndarray):  # an ndarray that notes the thread that copies it
        def __array_finalize__(self, obj: object) -> None:
            seen.add(threading.current_thread().name)

    arrays = [a.view(Recorded) for a in images(256)]
    seen.clear()
    stack(arrays)
    assert any(name.startswith("clipserve-stack") for name in seen), seen


def test_a_chunk_that_does_not_fit_raises_and_leaves_nothing_running() -> None:
    arrays = images(256)
    arrays[200] = np.zeros((224, 224, 4), np.uint8)  # in a chunk copied by the pool
    with pytest.raises(ValueError):
        stack(arrays)
    arrays[200] = np.zeros(IMAGE, np.float32)  # a dtype uint8 cannot take
    with pytest.raises(TypeError):
        stack(arrays)
    with pytest.raises(ValueError):
        stack([])


def parallel_here() -> bool:
    return threads_for(256 * int(np.prod(IMAGE)), resolve_workers(0)) > 1


def test_nothing_writes_into_the_output_after_an_error_is_raised() -> None:
    if not parallel_here():
        pytest.skip("one usable core: one thread by design")
    for _ in range(5):
        arrays = images(256)
        arrays[0] = np.zeros((224, 224, 4), np.uint8)  # the caller's own chunk fails at once
        out = np.zeros((256, *IMAGE), np.uint8)
        with pytest.raises(ValueError):
            stack_into(arrays, out)
        seen = out.copy()  # the pool's chunks, if any ran, are complete by now
        time.sleep(0.05)
        np.testing.assert_array_equal(out, seen)


def test_a_forked_child_stacks_without_the_parents_threads() -> None:
    if not parallel_here() or not hasattr(os, "fork"):
        pytest.skip("one usable core, or no fork")
    arrays = images(256)
    stack(arrays)  # the pool's threads exist in this process now
    pid = os.fork()
    if pid == 0:  # the child: it would wait forever on threads that were not forked
        signal.alarm(20)
        try:
            ok = np.array_equal(stack(arrays), np.stack(arrays))
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung stacking")
    assert os.waitstatus_to_exitcode(status) == 0
