"""The zero-code hook's inlined collective path writes the slot as ``Lane.call`` does (issue 11).

``autohook._wrap_collective`` does what ``slot_writer.Lane.call`` does inline
(one Python frame less per collective).  A real rank process (the runtime
claims a slot of a real segment, as under ``supervise serve``) makes the same
calls both ways, and the slot the supervisor reads must tell the same story:
inside, "in collective <op>", one more collective counted, a fresh
``ts_coll_begin`` that is also the heartbeat, the description written late
from the call's arguments; after, outside, nothing of the call kept; an
exception leaves the collective all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys, time
    from tp_supervise.supervisor.rank import autohook, heartbeat as hb, runtime, works

    runtime.starting()
    runtime.ready()
    with open(os.environ[runtime.ENV_HEARTBEAT], "rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

    def read():
        base = hb.HEADER_SIZE
        s = hb._decode(0, view[base : base + hb.SLOT_SIZE], torn=False)
        return {"in": s.in_collective, "op": s.coll_op, "desc": s.coll_desc, "seq": s.coll_seq,
                "ts_coll": s.ts_coll_begin, "ts_hb": s.ts_heartbeat}

    out = {}

    def observe(key):
        def fn(objects, tag=None):
            works.monitor.tick()  # the monitor's pass while the call lasts: the late description
            out[key] = read()
            if tag == "raise":
                raise RuntimeError("collective failed")
        return fn

    ln = runtime.lane()
    for way in ("hook", "lane"):
        before = read()
        time.sleep(0.01)
        if way == "hook":
            autohook._wrap_collective("all_gather_object", observe(way))([1, 2, 3], tag="x")
        else:
            ln.call("all_gather_object", observe(way), ([1, 2, 3],), {"tag": "x"}, time.monotonic())
        out[way + "_before"] = before
        out[way + "_after"] = read()
        out[way + "_kept"] = [ln.depth, ln.args, ln.kwargs]
        try:
            if way == "hook":
                autohook._wrap_collective("all_gather_object", observe(way + "_raise"))([1], tag="raise")
            else:
                ln.call("all_gather_object", observe(way + "_raise"), ([1],), {"tag": "raise"}, time.monotonic())
        except RuntimeError:
            out[way + "_raised"] = read()
    print(json.dumps(out))
    """
)


def test_hook_and_lane_call_write_the_same_slot(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, uuid.uuid4().hex, time.monotonic())
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISE_")}
        env.update({runtime.ENV_HEARTBEAT: str(seg.path), runtime.ENV_SLOT: "0", "RANK": "0"})
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        seg.close()

    for way in ("hook", "lane"):
        before, inside, after = out[way + "_before"], out[way], out[way + "_after"]
        assert not before["in"] and inside["in"] and not after["in"], way
        assert inside["op"] == "all_gather_object" and inside["desc"] == "3 objects", way
        assert inside["seq"] == before["seq"] + 1 and after["seq"] == inside["seq"], way
        assert inside["ts_coll"] > before["ts_hb"], f"{way}: entering is a heartbeat"
        assert inside["ts_hb"] == inside["ts_coll"], f"{way}: the reader reports the collective's begin"
        assert out[way + "_kept"] == [0, None, None], f"{way}: nothing of the call kept after it"
        raised = out[way + "_raised"]
        assert not raised["in"] and raised["seq"] == after["seq"] + 1, f"{way}: a failed call leaves too"
