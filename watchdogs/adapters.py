"""External progress: an engine's own Prometheus counters, for ranks whose collectives never reach Python.

Engines that replay CUDA graphs run their per-layer collectives inside the
graph, so the zero-code hook sees none of them.  Their frontends still export
how many requests run and how many tokens were generated; requests running
with a flat token counter is the same "busy without progress" signal the
heartbeat gives.

Metric names (from the engines' documentation; each engine's module,
``supervisor/rank/engines/<engine>.py``, holds them):

=========  ===============================  ===========================
engine     generated tokens (counter)       running requests (gauge)
=========  ===============================  ===========================
vLLM       ``vllm:generation_tokens_total``  ``vllm:num_requests_running``
SGLang     ``sglang:generation_tokens_total``  ``sglang:num_running_reqs``
=========  ===============================  ===========================

Samples of a family are summed over their label sets (``model_name``,
``engine``, ``tp_rank`` …): a sum moves when any member moves and is positive
when any member is, which is all the policy asks.  Only the exact sample name
is used (``_created`` samples are ignored).

``PrometheusProgress.scrape()`` never raises: failures come back as
``ExternalProgress(ok=False, error=...)``.  ``ExternalProgress`` itself lives
in ``watchdogs.progress`` (pure data the policy reads without importing this
module's HTTP client and parser).
"""

from __future__ import annotations

import http.client
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import ModuleType

from prometheus_client.parser import text_string_to_metric_families

from tp_supervise.supervisor.rank import engines

from .progress import ExternalProgress

DEFAULT_SCRAPE_TIMEOUT = 2.0
MAX_BODY_BYTES = 32 * 1024 * 1024
READ_CHUNK = 64 * 1024
ERROR_TEXT_LIMIT = 200


@dataclass(frozen=True)
class EngineMetrics:
    """Which sample names carry an engine's token counter and running gauge (first found wins)."""

    engine: str
    tokens: tuple[str, ...]
    running: tuple[str, ...]


def _of(engine: ModuleType) -> EngineMetrics:
    """An engine's metric names, as its module (``supervisor/rank/engines/<engine>.py``) declares them."""
    return EngineMetrics(engine.NAME, tokens=engine.METRIC_TOKENS, running=engine.METRIC_RUNNING)


VLLM = _of(engines.vllm)
SGLANG = _of(engines.sglang)
ENGINES = {m.engine: m for m in map(_of, engines.ENGINES)}


def failed(error: str) -> ExternalProgress:
    text = "".join(c if c.isprintable() else "?" for c in error[:ERROR_TEXT_LIMIT])
    return ExternalProgress(tokens_total=0.0, running=0.0, ok=False, error=text)


def _sum_samples(totals: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in totals:
            return totals[name]
    return None


def parse_progress(text: str, engines: tuple[EngineMetrics, ...] = (VLLM, SGLANG)) -> ExternalProgress:
    """Extract progress from a Prometheus text exposition (pure)."""
    wanted = {n for m in engines for n in m.tokens + m.running}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    value = float(sample.value)
                    if math.isnan(value):
                        continue
                    totals[sample.name] = totals.get(sample.name, 0.0) + value
    except Exception as exc:  # foreign text: any parser failure means "unknown", never an error
        return failed(f"unparsable metrics: {type(exc).__name__}: {exc}")
    for engine in engines:
        tokens = _sum_samples(totals, engine.tokens)
        running = _sum_samples(totals, engine.running)
        if tokens is not None and running is not None:
            return ExternalProgress(tokens_total=tokens, running=running, ok=True)
    expected = " or ".join(f"{m.tokens[0]} + {m.running[0]}" for m in engines)
    return failed(f"metrics lack {expected}")


class PrometheusProgress:
    """Scrapes one engine's ``/metrics`` endpoint.

    ``engine`` is "vllm", "sglang" or "auto" (whichever family is present).
    Proxies from the environment are ignored: the endpoint is the engine's own,
    on this node.  ``timeout`` bounds each socket operation and the body read
    as a whole, so a scrape returns within about twice ``timeout`` (connect,
    then a read that started just before the deadline).
    """

    def __init__(self, url: str, engine: str = "auto", timeout: float = DEFAULT_SCRAPE_TIMEOUT):
        if engine != "auto" and engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected auto, {', '.join(ENGINES)}")
        if not (math.isfinite(timeout) and timeout > 0.0):
            raise ValueError(f"scrape timeout must be positive, got {timeout}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"metrics URL must be http(s), got {url!r}")
        self.url = url
        self.timeout = timeout
        self.engines = tuple(ENGINES.values()) if engine == "auto" else (ENGINES[engine],)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(self) -> str:
        """The endpoint's body (raises OSError/ValueError on any failure, TimeoutError past the deadline)."""
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
        with self._opener.open(request, timeout=self.timeout) as response:
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"scrape exceeded {self.timeout:g} s")
                chunk = response.read(READ_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"metrics body larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
            charset = response.headers.get_content_charset() or "utf-8"
        return b"".join(chunks).decode(charset, "replace")

    def scrape(self) -> ExternalProgress:
        """One scrape; never raises."""
        try:
            text = self.fetch()
        except urllib.error.HTTPError as exc:
            exc.close()
            return failed(f"HTTP {exc.code} from {self.url}")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            return failed(f"{self.url}: {type(reason).__name__}: {reason}")
        except Exception as exc:  # an I/O edge the watchdog relies on: report, never raise
            return failed(f"{self.url}: unexpected {type(exc).__name__}: {exc}")
        return parse_progress(text, self.engines)
