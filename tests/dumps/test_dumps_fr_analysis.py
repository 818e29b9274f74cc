"""Cross-rank flight-recorder analysis (pure) and the environment contract."""

from __future__ import annotations

import os

from tp_supervise.dumps import flight_capture as flight
from tp_supervise.supervisor.rank import flight as rank_flight
from tp_supervise.dumps.fr_analysis import analyze


def entry(seq, *, pg="0", op="gloo:all_reduce", sizes=((64, 256),), dtype="Float", retired=True, p2p=False):
    return {
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "process_group": [pg, "default_pg" if pg == "0" else f"pg{pg}"],
        "profiling_name": op,
        "input_sizes": [list(s) for s in sizes],
        "input_dtypes": [dtype] * len(sizes),
        "output_sizes": [list(s) for s in sizes],
        "is_p2p": p2p,
        "retired": retired,
        "state": "scheduled",
    }


def trace(entries, pg_config=None):
    return {"version": "2.10", "entries": entries, "pg_config": pg_config or {}, "pg_status": {}}


def test_last_seq_and_missing_rank():
    traces = {
        0: trace([entry(s) for s in (1, 2, 3)] + [entry(4, retired=False)]),
        1: trace([entry(s) for s in (1, 2, 3)]),
        2: trace([entry(s) for s in (1, 2, 3)] + [entry(4, retired=False)]),
    }
    f = analyze(traces)
    assert f.ranks == (0, 1, 2)
    assert dict(f.last_seq["0"]) == {0: 4, 1: 3, 2: 4}
    assert len(f.missing) == 1
    m = f.missing[0]
    assert (m.pg, m.seq, m.op, m.desc, m.entered, m.missing) == ("0", 4, "all_reduce", "64x256 float32", (0, 2), (1,))
    assert f.culprit_ranks == (1,)
    assert f.in_flight[0].seq == 4 and 1 not in f.in_flight
    assert not f.mismatches


def test_most_behind_rank_is_the_root_cause():
    traces = {
        0: trace([entry(s) for s in range(1, 9)]),
        1: trace([entry(s) for s in range(1, 6)]),  # 3 behind
        2: trace([entry(s) for s in range(1, 8)]),  # 1 behind
    }
    f = analyze(traces)
    assert [(m.seq, m.missing) for m in f.missing] == [(6, (1,)), (8, (2,))]
    assert f.missing[0].entered == (0, 2) and f.missing[1].entered == (0,)
    assert f.culprit_ranks == (1,)


def test_rank_with_no_entry_in_default_group_is_missing():
    f = analyze({0: trace([entry(1)]), 1: trace([])})
    assert f.missing[0].missing == (1,) and f.missing[0].last_seq == {1: 0}


def test_mismatch_kinds_and_minority():
    traces = {
        0: trace([entry(1), entry(2)]),
        1: trace([entry(1), entry(2, sizes=((32, 256),), dtype="Half")]),
        2: trace([entry(1), entry(2)]),
    }
    f = analyze(traces)
    assert len(f.mismatches) == 1
    mm = f.mismatches[0]
    assert mm.seq == 2 and mm.kinds == ("size", "dtype") and mm.minority == (1,)
    assert mm.by_rank[1] == "all_reduce 32x256 float16"
    assert f.culprit_ranks == (1,)  # no rank is missing: the mismatch names the culprit


def test_op_mismatch_tie_has_no_minority():
    f = analyze({0: trace([entry(1)]), 1: trace([entry(1, op="gloo:all_gather")])})
    assert f.mismatches[0].kinds == ("op",) and f.mismatches[0].minority == ()
    assert f.culprit_ranks == ()


def test_p2p_entries_are_ignored():
    f = analyze({0: trace([entry(1), entry(2, p2p=True)]), 1: trace([entry(1)])})
    assert not f.missing and not f.mismatches


def test_subgroup_members_from_pg_config():
    conf = {"0": {"ranks": "[0, 1, 2, 3]"}, "5": {"ranks": "[2, 3]"}}
    traces = {
        0: trace([entry(1)], conf),
        1: trace([entry(1)], conf),
        2: trace([entry(1), entry(1, pg="5"), entry(2, pg="5")], conf),
        3: trace([entry(1), entry(1, pg="5")], conf),
    }
    f = analyze(traces)
    assert dict(f.last_seq["5"]) == {2: 2, 3: 1}  # ranks 0,1 are not members of group 5
    assert [(m.pg, m.seq, m.missing) for m in f.missing] == [("5", 2, (3,))]


def test_empty_input():
    f = analyze({})
    assert f.ranks == () and not f.missing and not f.mismatches and f.culprit_ranks == ()
    assert analyze({0: {"entries": None}}).last_seq == {}


def test_to_dict_is_json_ready():
    import json

    f = analyze({0: trace([entry(1), entry(2, retired=False)]), 1: trace([entry(1)])})
    d = json.loads(json.dumps(f.to_dict()))
    assert d["culprit_ranks"] == [1] and d["missing"][0]["missing"] == [1]
    assert d["in_flight"]["0"]["seq"] == 2


def test_rank_env_user_values_win(tmp_path):
    env = rank_flight.rank_env(tmp_path, 3, environ={})
    assert env[rank_flight.ENV_FR_BUFFER] == str(rank_flight.DEFAULT_FR_BUFFER)
    assert env[rank_flight.ENV_WORKER_SOCKET] == rank_flight.socket_path(tmp_path, 3)
    assert env[rank_flight.ENV_WORKER_SOCKET].endswith("slot-3.sock")
    kept = rank_flight.rank_env(tmp_path, 3, environ={rank_flight.ENV_FR_BUFFER: "0"})
    assert rank_flight.ENV_FR_BUFFER not in kept and rank_flight.ENV_WORKER_SOCKET in kept


def test_socket_path_fits_unix_limit(tmp_path):
    deep = tmp_path / ("d" * 120)
    path = rank_flight.socket_path(deep, 7)
    assert len(path.encode()) <= rank_flight.UNIX_PATH_MAX
    assert path == rank_flight.socket_path(str(deep), 7)  # both sides agree
    assert path != rank_flight.socket_path(deep, 8)


def test_collect_reports_missing_socket_and_dead_rank(tmp_path):
    from tp_supervise.dumps.capture import RankTarget

    targets = [
        RankTarget(rank=0, slot=0, pid=os.getpid(), alive=True),
        RankTarget(rank=1, slot=1, pid=None, alive=False),
    ]
    traces, errors = flight.collect_detailed(targets, tmp_path, 1.0)
    assert traces == {}
    assert "no worker server socket" in errors[0] and errors[1] == "rank is not running"


def test_collect_times_out_on_a_server_that_never_answers(tmp_path):
    """A listening socket that never replies (a rank whose server thread is stuck)."""
    import socket
    import time

    from tp_supervise.dumps.capture import RankTarget

    path = rank_flight.socket_path(tmp_path, 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    try:
        start = time.monotonic()
        traces, errors = flight.collect_detailed([RankTarget(0, 0, os.getpid(), True)], tmp_path, 0.3)
        took = time.monotonic() - start
    finally:
        srv.close()
    assert traces == {} and "timeout" in errors[0]
    assert took < 5.0  # bounded by the timeout, generous margin for a loaded machine
