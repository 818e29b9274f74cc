"""The group behind the relay as the relay sees it: holding requests while it is down, sending suspects alone.

``Group`` is the relay's view of the engine's group and its one way to send
upstream (``send``: no deadline for a generation, interrupted by the run's
end).  After a failure under a request (``failed()``) one probe of the
engine's ``/health`` at a time waits for the next attempt to answer 200
(its connection may wait in rank 0's backlog, where nobody accepts between
attempts); every held request goes on then, and ``epoch`` +1.  A request
that meets a failed group waits in ``await_ready()``: at most ``hold_s``, at
most ``max_held`` at once, never past the run's end (``Ended``: its handler
answers 503 naming the incident).

A request whose answer is a 5xx the engine did not call the group's failure
(``is_failure(None)``) is held when the supervisor ruled a fault or the
engine's ``/health`` does not answer 200 within ``GROUP_CHECK_S``; else the
5xx is the request's own answer.  What the supervisor ruled, and its
quarantine, come as notices on the relay's stdin (``told``,
supervisor/relay/protocol.py), never from files polled here.

**The quarantine** (engines that do not check it themselves: the adapter's
``quarantines``).  ``Flight`` is one request's record in ``inflight-relay``
(supervisor/relay/protocol.py; the layout of engine/runfiles.py's in-flight
files), from each send until its first token or answer, with the relay's
epoch as its step: the supervisor blames the newest epoch only.  A
quarantined fingerprint is refused (``Refused``: 400).  A suspect of the
current crash loop is sent alone: nothing else is sent until its first
token or answer (``TURN_LIMIT_S`` at most), so if it fails the group again
it is the only request in flight; while any suspect is listed, only a
request sent alone is recorded.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping

import aiohttp

from tp_supervise.engine.log import get_logger
from tp_supervise.engine.openai_api import quarantined
from tp_supervise.engine.runfiles import InflightFile

from .engines import Adapter, request_fingerprint
from .protocol import RELAY_INFLIGHT_FILE, Counts, Notice

HOLD_S = 90.0  # the built-in engine's default: a request waits this long at most for the next attempt
DEFAULT_MAX_HELD = 1024  # requests held at once (waiting for the next attempt); past it a 503 with Retry-After
PROBE_TIMEOUT_S = 10.0  # one /health probe of a restarting group (it may wait in rank 0's backlog)
PROBE_PAUSE_S = 0.1  # between probes answered without a 200
GROUP_CHECK_S = 2.0  # a 5xx the engine did not call the group's failure: /health must answer 200 within this
CONNECT_TIMEOUT_S = 5.0  # loopback connect: the kernel completes it from the backlog
# A suspect is sent alone: nothing else is sent until its first token or its answer (a whole answer: of the request
# cut to one token, sent first).  Past this the turn passes on all the same (an engine that neither answers nor
# fails must not stall every request); the suspect stays recorded until its first token.
TURN_LIMIT_S = 60.0
INFLIGHT_SLOTS = 4096  # inflight-relay's slots (requests sent and not yet answered)

log = get_logger()


class Ended(Exception):
    """The request is answered 503 here: the run ends, the hold ran out, or too many are held (``args``: why,
    and the client's message when it is not the usual one)."""

    def __init__(self, why: str, message: str | None = None):
        super().__init__(why)
        self.message = message


class Refused(Exception):
    """The request is answered here with this error (quarantined): ``status`` and the OpenAI error body."""

    def __init__(self, status: int, body: dict):
        super().__init__(status)
        self.status, self.body = status, body


def _settle(task: asyncio.Future) -> None:
    """Retrieve a send's exception, so that one abandoned (its client left, the run ended) is no traceback."""
    if not task.cancelled():
        task.exception()


def _abandon(sending: asyncio.Future) -> None:
    """Stop a send nobody waits for: cancel it, or close the answer that already came."""
    if not sending.done():
        sending.cancel()
    elif not sending.cancelled() and sending.exception() is None:
        sending.result().close()


class Group:
    """The engine's group behind the relay, as far as the relay knows, and the upstream session to it."""

    def __init__(
        self,
        upstream: str,
        engine: Adapter,
        counts: Counts,
        run_dir: str | None = None,
        hold_s: float = HOLD_S,
        max_held: int = DEFAULT_MAX_HELD,
    ):
        self.upstream = upstream if upstream.startswith(("http://", "https://")) else f"http://{upstream}"
        self.engine = engine
        self.counts = counts
        self.run_dir = run_dir
        self.hold_s = hold_s
        self.max_held = max_held
        self.ending = asyncio.Event()  # the run ends: nothing is held or sent any more
        self.session: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()  # the group answers, as far as the relay knows (cleared at a failure)
        self.ready.set()
        self.served = False  # an attempt answered /health or a request (before: "starting", after: "restarting")
        self._probe: asyncio.Future | None = None
        self.ruled: str | None = None  # the incident the supervisor ruled, until its next attempt starts
        self._named = asyncio.Event()  # set while an incident is ruled
        # The incident of the failure the relay waits out: the supervisor clears its ruling before the next attempt
        # starts, while the relay may still hold requests (their 503s name it).
        self.last_incident: str | None = None
        self.epoch = 1  # +1 each time a new attempt is seen serving after a failure (inflight-relay's step)
        self.held = 0  # requests waiting for the next attempt now
        self.quarantined: Mapping[str, tuple[str, ...]] = {}  # fingerprint -> incidents (engines that do not check)
        self.suspects: frozenset[str] = frozenset()  # of the current crash loop: each is sent alone
        self.inflight: InflightFile | None = None
        self.cleared: dict[str, int] = {}  # suspect fingerprint -> the epoch in which it ran alone unharmed
        self.turn = asyncio.Lock()  # the suspect being sent alone holds it
        self.turn_free = asyncio.Event()
        self.turn_free.set()

    # -- the run's life ----------------------------------------------------------------
    async def open(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)  # every request its own connection
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.engine.records_requests and self.run_dir:
            try:
                self.inflight = InflightFile(os.path.join(self.run_dir, RELAY_INFLIGHT_FILE), INFLIGHT_SLOTS, 0)
            except OSError as exc:
                log.warning("in-flight record not made: no quarantine evidence from the relay", error=str(exc))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # -- what the supervisor tells ------------------------------------------------------
    def told(self, notice: Notice) -> None:
        """A notice from the supervisor: the incident it ruled (a SIGKILLed rank: ruled for half a second, until
        the next attempt starts; the relay keeps the last one it saw for the 503s of what it still holds), and
        its quarantine (kept only for an engine that does not check it itself)."""
        self.ruled = notice.incident
        if notice.incident is not None:
            self.last_incident = notice.incident
            self._named.set()
        else:
            self._named.clear()
        if not self.engine.quarantines:
            return
        quarantine = (dict(notice.quarantined), notice.suspects)
        if quarantine != (self.quarantined, self.suspects):
            self.quarantined, self.suspects = quarantine
            log.info("quarantine list received", fingerprints=len(self.quarantined), suspects=len(self.suspects))

    def incident(self) -> str | None:
        """The incident a 503 names: the one ruled now, or while the group is down the last one seen."""
        return self.ruled or (None if self.ready.is_set() else self.last_incident)

    async def incident_named(self, limit_s: float) -> None:
        """Until the supervisor's incident is known (a stream's error names it), at most ``limit_s``, or the end."""
        waits = [asyncio.ensure_future(self._named.wait()), asyncio.ensure_future(self.ending.wait())]
        try:
            await asyncio.wait(waits, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # -- the group's state --------------------------------------------------------------
    def failed(self) -> None:
        """An attempt failed under a request: resends wait until the next attempt answers /health 200."""
        if self.ready.is_set():
            self.ready.clear()
            self._probe = asyncio.ensure_future(self._probe_ready())

    async def _probe_ready(self) -> None:
        """One probe at a time: its connection may wait in rank 0's backlog until the next attempt answers it."""
        while not self.ending.is_set():
            if await self.health_ok(PROBE_TIMEOUT_S):
                self.epoch += 1
                self.last_incident = None
                self.ready.set()
                return
            await asyncio.sleep(PROBE_PAUSE_S)

    async def health_ok(self, timeout_s: float) -> bool:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(self.upstream + self.engine.health_path, timeout=timeout) as up:
                ok = up.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        self.served = self.served or ok
        return ok

    async def _failing(self) -> bool:
        """A 5xx the engine did not name: the group's failure when the supervisor ruled a fault or the engine's
        /health does not answer 200 at once; else it is the request's own answer."""
        if not self.ready.is_set() or self.ruled:
            return True
        return not await self.health_ok(GROUP_CHECK_S)

    async def is_failure(self, verdict: bool | None) -> bool:
        """Whether an answer is the group's failure (the adapter's verdict; None: ask the group)."""
        if verdict is None:
            verdict = not self.ending.is_set() and await self._failing()
        if verdict:
            self.failed()
        return bool(verdict)

    async def await_ready(self) -> None:
        """Until the group answers again; ``Ended`` when the run ends, the hold runs out, or too many wait."""
        if self.ready.is_set():
            return
        if self.ending.is_set():
            raise Ended("the run ended")
        if self.held >= self.max_held:
            raise Ended(
                f"{self.held} requests are already held for the engine's next attempt (--relay-max-held)",
                "the engine's group is restarting and the relay holds as many requests as it may; retry later",
            )
        self.held += 1
        self.counts.set("held", self.held)
        waits = [asyncio.ensure_future(self.ready.wait()), asyncio.ensure_future(self.ending.wait())]
        try:
            await asyncio.wait(waits, timeout=self.hold_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self.held -= 1
            self.counts.set("held", self.held)
        if not self.ready.is_set():
            raise Ended("the run ended" if self.ending.is_set() else f"no attempt answered within {self.hold_s:g} s")

    async def send(self, method: str, path: str, **kw) -> aiohttp.ClientResponse:
        """One upstream request, until its answer's headers (no deadline: a generation takes what it takes; a hung
        group is the supervisor's to end); the run's end interrupts the wait (``Ended``)."""
        assert self.session is not None
        if self.ending.is_set():
            raise Ended("the run ended")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        sending = asyncio.ensure_future(self.session.request(method, self.upstream + path, timeout=timeout, **kw))
        sending.add_done_callback(_settle)
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            done, _ = await asyncio.wait({sending, ending}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler was cancelled (its client left): the request must not go on
            _abandon(sending)
            raise
        finally:
            ending.cancel()
        if sending not in done:
            _abandon(sending)
            raise Ended("the run ended")
        return sending.result()

    # -- the quarantine (engines that do not check it themselves) ---------------------------
    def flight(self, path: str, body) -> Flight:
        fp = None
        if self.inflight is not None and isinstance(body, dict):
            fp = request_fingerprint(path, body)
        return Flight(self, fp)

    def quarantine_check(self, fp: str) -> None:
        incidents = self.quarantined.get(fp)
        if incidents is None:
            return
        self.counts.add("quarantined")
        log.warning("request quarantined", fingerprint=fp, incidents=list(incidents))
        raise Refused(400, quarantined(incidents).body())


class Flight:
    """One request's record in ``inflight-relay`` (the quarantine's evidence), and its turn when it is sent alone.

    A request is recorded from its send until its first answer (first token, or the whole answer): a request the
    group fails before that may be the one that failed it.  ``step`` is the relay's epoch (one per attempt it saw
    serve): the supervisor blames the newest epoch only, so a request still held from an earlier failure is not
    blamed again for this one."""

    def __init__(self, group: Group, fp: str | None):
        self.group, self.fp = group, fp
        self.key = uuid.uuid4().hex
        self._solo: asyncio.TimerHandle | None = None
        self._holds_turn = False

    async def sending(self) -> None:
        """Before each send: a suspect waits for its turn alone; anything else waits while a suspect has it."""
        group = self.group
        if group.inflight is None or self.fp is None:
            return
        group.quarantine_check(self.fp)
        group.inflight.remove(self.key)
        if self.fp in group.suspects and group.cleared.get(self.fp) != group.epoch:
            await group.turn.acquire()
            while not group.ready.is_set():  # the group failed under the one before: its turn is the next attempt's
                group.turn.release()
                await group.await_ready()
                await group.turn.acquire()
            self._holds_turn = True
            group.turn_free.clear()
            self._solo = asyncio.get_running_loop().call_later(TURN_LIMIT_S, self.release)
        else:
            while not group.turn_free.is_set():
                await group.turn_free.wait()
            if group.suspects:
                return  # a crash loop is being sorted out: only a request sent alone is evidence against it
        group.inflight.add(self.key, self.fp, group.epoch)

    @property
    def alone(self) -> bool:
        """It holds the turn: a suspect sent with nothing else."""
        return self._holds_turn

    def answered(self) -> None:
        """Its first token or answer came: no longer a suspect of a failure, and the same request is not sent
        alone again in this attempt (a client repeating it)."""
        if self.group.inflight is not None:
            self.group.inflight.remove(self.key)
        if self._holds_turn and self.fp is not None:
            self.group.cleared[self.fp] = self.group.epoch
        self.release()

    def release(self) -> None:
        if self._solo is not None:
            self._solo.cancel()
            self._solo = None
        if self._holds_turn:
            self._holds_turn = False
            self.group.turn.release()
            if not self.group.turn.locked():
                self.group.turn_free.set()

    def failed(self) -> None:
        """The group failed under it: its record stays (the supervisor reads it) until it is sent again."""
        self.release()

    def close(self) -> None:
        self.answered()
