"""`compute`: each device thread stacks its batches into memory it reuses, and no batch's
answer depends on the batch computed after it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from clipserve.backends.fake import FakeExecutor
from clipserve.batching import compute as compute_module
from clipserve.batching.compute import MAX_SCRATCH_KINDS, compute
from tests.helpers import SPEC_32, marked_array


def rows(outcome: compute_module.Outcome) -> np.ndarray:
    assert all(isinstance(r, np.ndarray) for r in outcome.rows)
    return np.stack(outcome.rows)  # type: ignore[arg-type]


def test_rows_of_a_batch_survive_the_next_batch_in_the_same_memory() -> None:
    fake = FakeExecutor(SPEC_32, 16)
    first = [marked_array(m) for m in range(8)]
    second = [marked_array(m) for m in range(100, 108)]
    mask = np.ones(8, dtype=bool)
    alone = rows(compute(fake, first, mask)).copy()
    a = compute(fake, first, mask)
    b = compute(fake, second, mask)  # stacked where `first` was
    np.testing.assert_array_equal(rows(a), alone)
    assert a.block is not None and b.block is not None
    assert not np.shares_memory(a.block, b.block)
    assert not np.allclose(rows(a), rows(b))


def test_memory_is_per_thread_grows_once_and_holds_few_kinds() -> None:
    fake = FakeExecutor(SPEC_32, 16)

    def buffers() -> dict[object, np.ndarray]:
        return dict(compute_module._scratch.__dict__.get("buffers", {}))

    def on_fresh_thread() -> list[int]:
        sizes = []
        for n in (4, 2, 9, 3):
            compute(fake, [marked_array(m) for m in range(n)], np.ones(n, dtype=bool))
            (buf,) = buffers().values()
            sizes.append(len(buf))
        return sizes

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(on_fresh_thread).result() == [4, 4, 9, 9]  # reused, grown once
    with ThreadPoolExecutor(1) as pool:  # another thread: its own memory
        assert pool.submit(lambda: buffers()).result() == {}

    def many_kinds() -> int:
        for side in range(1, MAX_SCRATCH_KINDS + 3):
            arrays = [np.zeros((side, 2), np.float32)]
            compute_module._stacked(arrays)
        return len(buffers())

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(many_kinds).result() <= MAX_SCRATCH_KINDS
