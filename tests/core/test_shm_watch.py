"""What the run's processes map in /dev/shm is noted while they live and removed once they are gone (vLLM's CPU
shm all-reduce buffers outlive a worker killed as a consequence of its engine core's death)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tp_supervise.supervisor.processes import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")

MAPPER = """
import mmap, os, sys, time
fds = []
for name in sys.argv[1:]:
    fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    fds.append(mmap.mmap(fd, 4096))
print("mapped", flush=True)
time.sleep(600)
"""


def _mapper(*names: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, *names], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "mapped"
    return proc


def _wait_seen(watch: shm.Watch, names: set[str], timeout: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while not names <= watch.seen() and time.monotonic() < deadline:
        time.sleep(0.02)
    return watch.seen()


def test_seen_while_alive_is_removed_once_gone():
    tag = uuid.uuid4().hex[:8]
    mapped = {f"test-shm-{tag}-a", f"test-shm-{tag}-b"}
    bystander = f"test-shm-{tag}-bystander"
    Path(shm.SHM_DIR, bystander).write_bytes(b"x")
    procs = [_mapper(name) for name in sorted(mapped)]
    try:
        watch = shm.Watch()
        watch.look([p.pid for p in procs] + [2**22 + 7])  # a pid that is gone already costs nothing
        assert mapped <= _wait_seen(watch, mapped)
        for p in procs:
            p.kill()
            p.wait()
        assert shm.inventory(p.pid for p in procs) == set()  # dead: nothing mapped any more, the watch remembers
        removed = shm.remove(watch.seen() | {bystander}, keep={bystander})
        assert set(removed) == mapped
        assert not any(Path(shm.SHM_DIR, n).exists() for n in mapped)
        assert Path(shm.SHM_DIR, bystander).exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for name in mapped | {bystander}:
            Path(shm.SHM_DIR, name).unlink(missing_ok=True)


def test_a_look_still_running_is_not_started_twice_and_keeps_what_it_read():
    """Looks are never stacked (one thread at a time), and what a look read counts even when the next look is
    asked for before it ends."""
    tag = uuid.uuid4().hex[:8]
    names = {f"test-shm-{tag}-{i}" for i in range(3)}
    procs = [_mapper(n) for n in sorted(names)]
    try:
        watch = shm.Watch()
        pids = [p.pid for p in procs] * 200  # a long look: 600 maps reads
        watch.look(pids)
        watch.look([])  # refused while the first runs
        assert names <= _wait_seen(watch, names, timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for name in names:
            Path(shm.SHM_DIR, name).unlink(missing_ok=True)
