"""Helpers for tests that talk to a running supervisor (registry, HTTP)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path


def wait_registry(registry: Path, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in registry.glob("*.json") if registry.is_dir() else []:
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no supervisor registered in {registry}")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(predicate, timeout: float, what: str = "condition", interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned), or fail."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def metric_value(exposition: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name != name:
                continue
            if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            return sample.value
    return None
