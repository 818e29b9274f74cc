"""Fixtures of the dump tests: real fake-rank processes, and a leak check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dumps_fakes import FakeRankSet  # noqa: E402

REAP_WAIT_S = 5.0


@pytest.fixture
def fake_ranks(tmp_path):
    """Factory: ``fake_ranks(n)`` -> a ``FakeRankSet`` closed after the test."""
    made: list[FakeRankSet] = []

    def make(nslots: int, **kwargs) -> FakeRankSet:
        s = FakeRankSet(tmp_path / f"set{len(made)}", nslots, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def no_leaked_children():
    """Every process a test started (ranks, py-spy) is gone when it ends."""
    yield
    me = psutil.Process()
    end = time.monotonic() + REAP_WAIT_S
    left = me.children(recursive=True)
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
