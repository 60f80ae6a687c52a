"""Shared-memory slots: what the front end writes, the engine reads in place, and back."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from clipserve.engine.slots import SlotArena, remove_segments, segment_path, shm_dir
from clipserve.errors import Overloaded


@pytest.fixture
def path() -> object:
    p = segment_path(os.getpid(), 1_000_000 + os.getpid())
    yield p
    p.unlink(missing_ok=True)


def test_items_and_embeddings_cross_between_two_mappings(path: object) -> None:
    front = SlotArena(path, 8, 3 * 224 * 224 * 4, create=True)  # type: ignore[arg-type]
    engine = SlotArena(path, 8, 3 * 224 * 224 * 4, create=False)  # type: ignore[arg-type]
    slots = front.take(3)
    assert slots == [0, 1, 2]  # lowest first: pages touched follow the peak in flight
    image = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    front.write(slots[1], image)
    seen = engine.view(slots[1], np.uint8, (224, 224, 3))
    np.testing.assert_array_equal(seen, image)  # no copy: the engine's view of the same bytes
    engine.write(slots[1], np.arange(512, dtype=np.float32))
    np.testing.assert_array_equal(front.view(slots[1], "<f4", (512,)), np.arange(512))
    front.give_back([slots[1]])
    assert front.take(1) == [1]
    with pytest.raises(ValueError):
        engine.view(0, np.float32, (3, 225, 225))  # bigger than a slot
    with pytest.raises(ValueError):
        engine.view(0, np.uint8, (2, -1))  # a negative size: never "the rest of the file"
    engine.close()
    front.close(unlink=True)
    assert not path.exists()  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [1, 3, 5, 12])  # rows one by one, and by a list of slots
def test_embedding_rows_cross_back_into_their_own_slots(path: object, n: int) -> None:
    front = SlotArena(path, 16, 4096, create=True)  # type: ignore[arg-type]
    engine = SlotArena(path, 16, 4096, create=False)  # type: ignore[arg-type]
    image = np.full(4096, 7, np.uint8)
    taken = front.take(16)
    for slot in taken:
        front.write(slot, image)  # what an item left there
    slots = taken[::-1][:n]  # out of order: each row to its own slot
    rows = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    engine.write_rows(slots, rows)
    back = front.read_rows(slots, 512)
    np.testing.assert_array_equal(back, rows)
    assert back.dtype == np.float32 and back.flags.owndata  # a copy: the slots are reused
    engine.write_rows(slots, np.zeros((n, 512), np.float32))
    np.testing.assert_array_equal(back, rows)
    for slot in set(taken) - set(slots):  # no other slot touched
        np.testing.assert_array_equal(front.view(slot, np.uint8, (4096,)), image)
    for slot in slots:  # past the row, the slot is as the item left it
        np.testing.assert_array_equal(front.view(slot, np.uint8, (4096,))[2048:], image[2048:])
    with pytest.raises(ValueError):
        engine.write_rows(slots, rows[:-1])  # a row short
    with pytest.raises(ValueError):
        engine.write_rows([16], rows[:1])  # no such slot
    with pytest.raises(ValueError):
        front.read_rows([-1], 512)  # a negative slot is not the last one
    with pytest.raises(ValueError):
        front.read_rows([0], 1025)  # longer than a slot
    engine.close()
    front.close(unlink=True)


def test_closing_an_arena_keeps_the_memory_its_views_still_read(path: object) -> None:
    """The engine closes a gone front end's arena while its items may still be copied into a
    batch: their views must keep the mapping (unmapped, reading one is a segfault, so this runs
    in a process of its own)."""
    code = (
        "import sys, numpy as np; from pathlib import Path; "
        "from clipserve.engine.slots import SlotArena; "
        "a = SlotArena(Path(sys.argv[1]), 4, 4096, create=True); "
        "item = a.view(1, np.uint8, (64, 64)); item[...] = 3; "
        "a.write_rows([2], np.ones((1, 8), np.float32)); "
        "a.close(unlink=True); "
        "print(int(item.sum()), int(np.stack([item, item]).sum()))"
    )
    argv = [sys.executable, "-c", code, str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["12288", "24576"]
    assert not path.exists()  # type: ignore[attr-defined]


def test_a_file_that_could_not_be_mapped_is_removed_so_the_next_try_can_make_it(
    path: object,
) -> None:
    """The front end makes its file with O_EXCL and retries under the same name after a
    failure: a file left behind would make every retry fail, and it would never reconnect."""
    with pytest.raises(OSError):  # 2^57 bytes: more than any x86-64 address space maps
        SlotArena(path, 1 << 27, 1 << 30, create=True)  # type: ignore[arg-type]
    assert not path.exists()  # type: ignore[attr-defined]
    SlotArena(path, 4, 4096, create=True).close(unlink=True)  # type: ignore[arg-type]


def test_running_out_of_slots_or_shared_memory_is_overloaded_not_a_crash(path: object) -> None:
    arena = SlotArena(path, 4, 1024, create=True)  # type: ignore[arg-type]
    arena.take(4)
    with pytest.raises(Overloaded, match="slots"):
        arena.take(1)
    arena.close(unlink=True)
    # A sparse file far larger than the filesystem: allocating its top slot fails with ENOSPC,
    # where writing to it would have been a SIGBUS.
    stat = os.statvfs(shm_dir())
    huge = SlotArena(path, 2, stat.f_bavail * stat.f_frsize + (1 << 30), create=True)  # type: ignore[arg-type]
    with pytest.raises(Overloaded, match="shared memory is full"):
        huge.take(1)
    assert huge.free == 2  # given back
    huge.close(unlink=True)


def test_remove_segments_unlinks_one_front_end_or_all(tmp_path: object) -> None:
    supervisor = 2_000_000 + os.getpid()
    for pid in (1, 2):
        SlotArena(segment_path(supervisor, pid), 1, 64, create=True).close()
    assert remove_segments(supervisor, 1) == 1
    assert segment_path(supervisor, 2).exists()
    assert remove_segments(supervisor) == 1
    assert not segment_path(supervisor, 2).exists()
