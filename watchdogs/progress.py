"""External progress samples: what an engine's own metrics say, as plain data.

The watchdog policy (``watchdogs.policy``) reads these; the engine adapters
(``watchdogs.adapters``) produce them by scraping.  Kept apart from the
adapters so the policy imports no HTTP client and no metrics parser.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExternalProgress:
    """One scrape: ``ok`` False means the numbers are unknown (``error`` says why)."""

    tokens_total: float
    running: float
    ok: bool
    error: str = ""

    def to_dict(self) -> dict:
        return {"tokens_total": self.tokens_total, "running": self.running, "ok": self.ok, "error": self.error}
