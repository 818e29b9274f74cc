"""bench_heartbeat rewrites only its own section of the shared benchmarks document."""

from __future__ import annotations

from bench.bench_heartbeat import HEADING, update_docs

OTHERS = "# Benchmarks\n\n## Engine throughput\n\nengine figures\n\n## Detection latency\n\nlead figures\n"


def test_appends_when_missing_and_keeps_other_sections(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(OTHERS)
    update_docs(doc, f"{HEADING}\n\nfirst\n")
    text = doc.read_text()
    assert "engine figures" in text and "lead figures" in text and text.endswith("first\n")


def test_replaces_only_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(OTHERS.replace("## Detection latency", f"{HEADING}\n\nold\n\n## Detection latency"))
    update_docs(doc, f"{HEADING}\n\nnew\n")
    text = doc.read_text()
    assert "old" not in text and "new" in text
    assert text.index("## Engine throughput") < text.index(HEADING) < text.index("## Detection latency")
    assert "lead figures" in text and text.count(HEADING) == 1


def test_creates_the_file(tmp_path):
    doc = tmp_path / "benchmarks.md"
    update_docs(doc, f"{HEADING}\n\nx\n")
    assert doc.read_text().startswith("# Benchmarks\n\n" + HEADING)
