"""Shared fixtures: run `supervise` as a real subprocess and prove nothing leaks.

Every process a test starts carries TP_SUPERVISE_TEST_MARK=<uuid> in its
environment (inherited by ranks and their children), so the leak check finds
them by /proc scan whatever their parent is.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.freezer import FREEZER_ROOT
from tests.support.logs import json_lines
from tests.support.sweep import sweep_killed

ROOT = Path(__file__).resolve().parent.parent
FAKE_RANK = ROOT / "tests" / "fakes" / "rank.py"
MARK_VAR = "TP_SUPERVISE_TEST_MARK"


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: under pytest-xdist, no other worker runs a test meanwhile (tests whose "
                                       "seconds-long node timeouts a second busy test on 2 cores can break)")


@pytest.fixture(autouse=True)
def _alone_under_xdist(request, tmp_path_factory):
    """Under pytest-xdist (make test), every test holds a shared lock on one file of the run and a test marked
    ``alone`` an exclusive one: it waits for the other worker's test in progress, which then waits for it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / "alone.lock"  # the workers' common root
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def marked_pids(mark: str) -> list[int]:
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat", "rb") as s:
                        state = s.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        found.append(int(entry))
        except OSError:
            continue
    return found


def event_name(text: str) -> str:
    """The event name the supervisor's JSON log gives a text (docs/logs.md): the
    headline (up to the first ``:``, ``;`` or ``(``), lower-cased, snake_case."""
    headline = re.split(r"[:;(]", text, maxsplit=1)[0]
    return re.sub(r"[^a-z0-9]+", "_", headline.lower()).strip("_")


def wait_no_marked(mark: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = marked_pids(mark)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


@dataclass
class Run:
    proc: subprocess.Popen
    dump_dir: Path
    mark: str
    started: float
    stdout: str = ""
    stderr: str = ""
    ended: float | None = None
    lines: list[dict] = field(default_factory=list)
    drains: list[tuple[threading.Thread, list[str]]] = field(default_factory=list)

    def drain(self) -> None:
        """Read stdout and stderr as they come (a long run's log would fill the pipes and block the supervisor's
        writes, and with them the engine's output it forwards)."""
        for stream in (self.proc.stdout, self.proc.stderr):
            chunks: list[str] = []
            thread = threading.Thread(target=lambda s=stream, c=chunks: c.extend(iter(s.readline, "")), daemon=True)
            thread.start()
            self.drains.append((thread, chunks))

    def _communicate(self, timeout: float) -> tuple[str, str]:
        if not self.drains:
            return self.proc.communicate(timeout=timeout)
        self.proc.wait(timeout=timeout)
        for thread, _ in self.drains:
            thread.join(30)
        return "".join(self.drains[0][1]), "".join(self.drains[1][1])

    def wait(self, timeout: float = 60.0) -> int:
        try:
            out, err = self._communicate(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            # Orphans of the killed supervisor may hold its pipes open.
            for pid in marked_pids(self.mark):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = self._communicate(30)
            pytest.fail(f"supervise did not exit within {timeout} s\nstderr:\n{err[-4000:]}")
        self.ended = time.monotonic()
        self.stdout, self.stderr = out, err
        self.lines = json_lines(err)
        return self.proc.returncode

    def lines_so_far(self) -> list[dict]:
        """The JSON log lines of a drained run that is still going (``lines`` once it ended)."""
        if self.ended is not None or not self.drains:
            return self.lines
        return json_lines("".join(list(self.drains[1][1])))

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def bundles(self) -> list[Path]:
        if not self.dump_dir.is_dir():
            return []
        return sorted(p for p in self.dump_dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def summary(self, reason: str) -> dict:
        matches = [b for b in self.bundles() if reason in b.name]
        assert matches, f"no {reason} bundle in {[b.name for b in self.bundles()]}\n{self.stderr[-3000:]}"
        return json.loads((matches[-1] / "summary.json").read_text())

    def events(self, text: str) -> list[dict]:
        """Lines whose human text contains ``text``, or whose event name is the name of ``text``.

        JSON lines carry the text in ``message`` and a stable snake_case name
        in ``event`` (docs/logs.md); ``events("rank exited")`` finds either.
        """
        name = event_name(text)
        return [
            line
            for line in self.lines_so_far()
            if text in str(line.get("message", "")) or text in str(line.get("event", "")) or line.get("event") == name
        ]

    def run_id(self) -> str | None:
        for line in self.lines:
            if line.get("run_id"):
                return line["run_id"]
        return None


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each names."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory's own descriptor, closed by now
            continue
    return out


@contextmanager
def supervisor_runs(tmp_path: Path):
    """Start `supervise serve` with test-friendly defaults; checks for leaks after
    (processes of the runs, and descriptors the test process gained)."""
    mark = uuid.uuid4().hex
    runs: list[Run] = []
    fds_before = open_fds()

    def start(args: list[str], command: list[str] | None = None, env: dict | None = None, **kw) -> Run:
        dump_dir = kw.pop("dump_dir", tmp_path / "dumps")
        default_linger = kw.pop("default_linger", False)
        drain = kw.pop("drain", False)
        entry = kw.pop("entry", None)  # a wrapper of the CLI (tests/fakes/*.py) in place of the module
        full_env = dict(os.environ)
        full_env[MARK_VAR] = mark
        full_env["SUPERVISE_REGISTRY_DIR"] = str(tmp_path / "registry")
        full_env.update(env or {})
        argv = [
            sys.executable,
            *(["-m", "tp_supervise.supervisor.cli"] if entry is None else [str(entry)]),
            "serve",
            "--log-format",
            "json",
            "--metrics-addr",
            kw.pop("metrics_addr", "127.0.0.1:0"),
            "--dump-dir",
            str(dump_dir),
            # no linger after a fault unless a test asks (the default keeps /metrics up 11 s for Prometheus)
            *([] if default_linger or "--metrics-linger" in args else ["--metrics-linger", "0"]),
            *args,
        ]
        if command is not None:
            argv += ["--", *command]
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
        )
        run = Run(proc=proc, dump_dir=dump_dir, mark=mark, started=time.monotonic())
        if drain:
            run.drain()
        runs.append(run)
        return run

    start.mark = mark
    start.tmp = tmp_path
    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run._communicate(60)
    leaked = wait_no_marked(mark, timeout=3.0)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"processes leaked: {leaked}"
    sweep_killed(tmp_path / "registry", {run.proc.pid for run in runs if run.proc.returncode == -signal.SIGKILL})
    for run in runs:  # a run the test waited on itself (proc.wait after a SIGKILL) still holds its pipes
        for stream in (run.proc.stdout, run.proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    gc.collect()  # descriptors of objects the test dropped are closed by their finalizers
    gained = {fd: target for fd, target in open_fds().items() if fds_before.get(fd) != target}
    assert not gained, f"the test process gained descriptors over the supervised runs: {gained}"


@pytest.fixture
def supervise(tmp_path):
    """`supervise serve` runs of one test (see supervisor_runs)."""
    with supervisor_runs(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def supervise_module(tmp_path_factory):
    """`supervise serve` runs shared by the tests of one module: one scenario run once, asserted by several
    tests (each checks its own behaviour of the same run).  ``start.tmp`` is the run's directory."""
    with supervisor_runs(tmp_path_factory.mktemp("module")) as start:
        yield start


def fake_rank(*args: str) -> list[str]:
    return [sys.executable, str(FAKE_RANK), *args]


@pytest.fixture
def freezer(tmp_path):
    """A cgroup v1 freezer of our own (tests/support/freezer.py); thawed and removed at the end, whatever
    happened."""
    if not (FREEZER_ROOT / "freezer.state").exists() and not FREEZER_ROOT.is_dir():
        pytest.skip("no cgroup v1 freezer hierarchy mounted (a frozen task is the only survivor of SIGKILL)")
    path = FREEZER_ROOT / f"tp-supervise-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a freezer cgroup: {exc}")
    yield path
    (path / "freezer.state").write_text("THAWED")
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
