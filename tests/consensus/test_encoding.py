"""Canonical encoding: equal decisions hash equal, in any process."""

from __future__ import annotations

import os
import subprocess
import sys

from tp_supervise.supervisor.rank import encoding
from tp_supervise.supervisor.rank.encoding import decode_event, digest, encode_event

SAMPLE = {
    "ids": ("req-2", "req-1"),
    "set": {"b", "a", "c", "d", "e"},
    "nested": {"z": 1, "a": [1.5, None, True, b"\x00\xff"]},
    "neg_zero": -0.0,
    "nan": float("nan"),
    "unicode": "tokén",
}

PROBE = """
import sys
from tp_supervise.supervisor.rank.encoding import encode_event
sys.stdout.write(encode_event("k", {"ids": ("req-2", "req-1"), "set": {"b", "a", "c", "d", "e"},
    "nested": {"a": [1.5, None, True, b"\\x00\\xff"], "z": 1}, "neg_zero": -0.0, "nan": float("nan"),
    "unicode": "tok\\u00e9n"}))
"""


def test_dict_order_and_container_type_do_not_matter():
    assert encode_event("k", {"a": 1, "b": 2}) == encode_event("k", {"b": 2, "a": 1})
    assert encode_event("k", (1, 2)) == encode_event("k", [1, 2])
    assert encode_event("k", {3, 1, 2}) == encode_event("k", [1, 2, 3])


def test_distinct_values_encode_distinct():
    pairs = [(1, True), (0, False), (1, 1.0), (0.0, -0.0), (None, 0), ("1", 1), ([1], 1), (b"a", "a")]
    for a, b in pairs:
        assert encode_event("k", a) != encode_event("k", b), (a, b)
    assert encode_event("a", 1) != encode_event("b", 1)


def test_lines_have_no_newline_and_are_ascii():
    line = encode_event("k\n", {"s": "a\nb", "u": "é"})
    assert "\n" not in line and line.isascii()
    assert decode_event(line) == ("k\n", {"s": "a\nb", "u": "é"})


def test_bytes_and_tolist_objects():
    class Arr:
        def tolist(self):
            return [1, 2]

    assert decode_event(encode_event("k", {"b": b"\x01", "a": Arr()})) == ("k", {"a": [1, 2], "b": {"$bytes": "01"}})


def test_unencodable_payload_falls_back_to_repr():
    class Thing:
        def __repr__(self):
            return "Thing(1)"

    assert decode_event(encode_event("k", Thing())) == ("k", {"$repr": "Thing(1)"})
    assert decode_event(encode_event("k", {1: "a", "b": 2})) == ("k", {"$repr": "{1: 'a', 'b': 2}"})


def test_same_encoding_in_processes_with_different_hash_seeds():
    here = encode_event("k", SAMPLE)
    outs = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout)
    assert outs == {here}
    assert len({digest(o.encode()) for o in outs}) == 1


def test_digest_pieces_equal_whole():
    blob = b"a\nbb\nccc"
    h = encoding.new_hasher()
    h.update(b"a")
    h.update(b"\nbb\nccc")
    assert h.digest() == digest(blob) and len(digest(blob)) == encoding.DIGEST_SIZE
    assert encoding.split_log(b"") == [] and encoding.split_log(blob) == [b"a", b"bb", b"ccc"]
