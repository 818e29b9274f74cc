"""torch's own flight-recorder files in the bundle, and the fr/ files torchfrtrace reads.

NCCL cannot run here, so its dump-on-timeout files are planted where the
ranks would write them (``TORCH_FR_DUMP_TEMP_FILE`` from ``rank_env``).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

from tp_supervise.dumps import flight_capture as flight
from tp_supervise.dumps.bundle import SUMMARY_JSON, BundleWriter
from tp_supervise.dumps.incident import write_incident
from tp_supervise.supervisor.rank import flight as rank_flight

DEADLINE_S = 8.0
FAITHFUL_TIMEOUT_S = 120


def test_rank_env_points_torch_into_the_run_dir_unless_the_user_chose(tmp_path):
    env = rank_flight.rank_env(tmp_path, 0, environ={})
    prefix = env[rank_flight.ENV_FR_DUMP_FILE]
    assert prefix == str(tmp_path / "fr-dump" / "rank-") and (tmp_path / "fr-dump").is_dir()
    for name in (rank_flight.ENV_FR_DUMP_FILE, rank_flight.ENV_FR_DUMP_FILE_LEGACY):
        mine = rank_flight.rank_env(tmp_path, 0, environ={name: "/elsewhere/trace_"})
        assert rank_flight.ENV_FR_DUMP_FILE not in mine


def test_torch_dumps_are_copied_safely_into_the_bundle(fake_ranks, tmp_path):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "collective"})
    rank_flight.rank_env(ranks.run_dir, 0, environ={})  # what the supervisor does at launch
    where = rank_flight.dump_dir(ranks.run_dir)
    trace = {"version": "2.10", "pg_config": {}, "entries": [{"collective_seq_id": 1, "frames": []}]}
    with open(os.path.join(where, "rank-0"), "wb") as f:
        pickle.dump(trace, f)
    secret = tmp_path / "secret"
    secret.write_text("not evidence")
    os.symlink(secret, os.path.join(where, "rank-1"))
    os.mkfifo(os.path.join(where, "rank-2"))  # nobody writes it: reading it must not block
    with open(os.path.join(where, "rank-3"), "wb") as f:
        f.truncate(flight.TORCH_DUMP_MAX_BYTES + 1)
    (tmp_path / "ignored").write_text("x")
    os.link(tmp_path / "ignored", os.path.join(where, "notes.txt"))

    writer = BundleWriter(tmp_path / "dumps", keep=5, max_bytes=0)
    res = write_incident(
        writer, reason="hang", run_id=ranks.run_id, targets=ranks.targets(), run_dir=ranks.run_dir,
        deadline_s=DEADLINE_S,
    )
    assert res.ok, res.error
    copied = res.path / "fr-torch"
    assert sorted(p.name for p in copied.iterdir()) == ["rank-0"]
    assert pickle.loads((copied / "rank-0").read_bytes()) == trace
    dumps = json.loads((res.path / SUMMARY_JSON).read_text())["flight_recorder"]["torch_dumps"]
    assert dumps["0"]["copied"] and dumps["0"]["size"] > 0
    assert dumps["1"]["error"] == "a symbolic link"
    assert dumps["2"]["error"] == "not a regular file"
    assert "larger than" in dumps["3"]["error"]
    assert set(dumps) == {"0", "1", "2", "3"}


def test_no_dump_dir_no_torch_dumps(tmp_path):
    assert flight.collect_torch_dumps(tmp_path, 1.0) == []


FAITHFUL = """
import json, os, pickle, sys, time
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
from tp_supervise.dumps.flight_capture import fr_dump
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(8, 4)
dist.all_reduce(t)
dist.broadcast(t, 0)
sub = dist.new_group([0])
dist.all_gather([torch.zeros(2)], torch.ones(2), group=sub)
dist.barrier()
# gloo marks a collective completed from its work's callback, after the call returned: both dumps are taken of
# a settled recorder (a clean-clone CI run compared a pickle that saw 1 completed with a JSON that saw 3).
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    status = json.loads(_dump_fr_trace_json())["pg_status"].values()
    if all(s["last_completed_collective"] == s["last_enqueued_collective"] for s in status):
        break
    time.sleep(0.01)
real = pickle.loads(_dump_fr_trace(includeStackTraces=False))
ours = fr_dump(json.loads(_dump_fr_trace_json()))
real.pop("pg_config"); ours.pop("pg_config")  # gloo's table is incomplete in both; compared apart
print("SAME" if real == ours else "DIFF\\n%r\\n%r" % (real, ours))
dist.destroy_process_group()
"""


def test_fr_dump_is_what_torch_pickles_itself():
    """From a real gloo process: the JSON the worker server serves, converted, equals torch's own pickle."""
    done = subprocess.run([sys.executable, "-c", FAITHFUL], capture_output=True, text=True, timeout=FAITHFUL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "SAME", done.stdout[-3000:]


def test_gloo_group_table_is_completed_for_torchfrtrace():
    entry = {"process_group": ["0", "default_pg"], "collective_seq_id": 1, "time_discovered_started_ns": 0}
    sub = {"process_group": ["1", "tp"], "collective_seq_id": 1}
    traces = {0: {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}, "entries": [entry, sub]}}
    members = flight.group_members(traces, world=[0, 1])
    assert members == {"0": [0, 1], "1": [0]}
    out = flight.fr_dump(traces[0], members)
    assert set(out["pg_config"]) == {"0", "1"}
    assert out["pg_config"]["0"]["ranks"] == "[0, 1]" and out["pg_config"]["0"]["desc"] == "default_pg"
    assert out["entries"][0]["process_group"] == ("0", "default_pg")
    assert out["entries"][0]["time_discovered_started_ns"] is None
