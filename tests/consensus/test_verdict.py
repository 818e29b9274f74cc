"""Verdict building: culprits, reference, the sentence, the bundle files."""

from __future__ import annotations

import json

from tp_supervise.supervisor.rank import encoding
from tp_supervise.consensus.compare import MAJORITY, PLURALITY, TIE
from tp_supervise.consensus.verdict import build_verdict, render_path


def enc(*events):
    return [encoding.encode_event(k, p).encode() for k, p in events]


def logs_for(tokens_by_rank):
    return {r: enc(("batch", {"ids": ["a"]}), ("sample", {"tokens": [t, 5]})) for r, t in tokens_by_rank.items()}


def verdict_for(tokens_by_rank, step=20, notes=None, missing=()):
    logs = logs_for(tokens_by_rank)
    digests = {r: encoding.digest(b"\n".join(v)) for r, v in logs.items()}
    counts = {r: len(v) for r, v in logs.items()}
    return build_verdict(step, digests, counts, logs, notes or {}, missing, detected_at=5.0, published_at=4.5)


def test_two_way_split_names_rank_1_and_says_no_majority():
    v = verdict_for({0: 42, 1: 17})
    assert v.culprit_ranks == (1,) and v.reference_ranks == (0,) and v.decided_by == TIE
    assert v.values == {0: 42, 1: 17}
    assert v.verdict == (
        "rank 1 diverged at step 20: event #1 'sample' tokens[0] is 17 where rank 0 has 42 "
        "(no majority in a two-way split; rank 0 taken as reference)"
    )


def test_rank0_diverging_in_a_pair_is_still_blamed_on_rank_1():
    # with two ranks nobody can tell who is right: rank 0 is the reference by rule
    v = verdict_for({0: 17, 1: 42})
    assert v.culprit_ranks == (1,)
    assert "no majority in a two-way split" in v.verdict


def test_three_ranks_majority_names_rank_0():
    v = verdict_for({0: 17, 1: 42, 2: 42})
    assert v.culprit_ranks == (0,) and v.reference_ranks == (1, 2) and v.decided_by == MAJORITY
    assert v.verdict.startswith("rank 0 diverged at step 20: event #1 'sample' tokens[0] is 17 where rank 1 has 42")
    assert "ranks 1, 2 agree: majority of 2 of 3" in v.verdict


def test_four_ranks_two_culprits_with_different_values():
    v = verdict_for({0: 42, 1: 17, 2: 42, 3: 18})
    assert v.culprit_ranks == (1, 3) and v.decided_by == PLURALITY
    assert "ranks 1, 3 diverged" in v.verdict and "17 on rank 1, 18 on rank 3" in v.verdict


def test_four_ranks_two_two_tie():
    v = verdict_for({0: 42, 1: 17, 2: 17, 3: 42})
    assert v.reference_ranks == (0, 3) and v.culprit_ranks == (1, 2)
    assert "no majority (2 groups tie at 2); ranks 0, 3 taken as reference" in v.verdict


def test_missing_logs_are_explained():
    logs = logs_for({0: 42, 1: 17})
    digests = {r: encoding.digest(b"\n".join(v)) for r, v in logs.items()}
    v = build_verdict(3, digests, {0: 2, 1: 2}, {0: logs[0], 1: None}, {1: "overwritten"}, (), 1.0, 1.0)
    assert v.first_difference is None and v.culprit_ranks == (1,)
    assert "event logs could not be diffed (rank 1: overwritten)" in v.verdict


def test_kinds_and_lengths_in_sentence():
    ref = enc(("batch", 1), ("sample", 2))
    bad = enc(("batch", 1), ("stop", 2))
    digests = {0: b"a" * 16, 1: b"b" * 16}
    v = build_verdict(1, digests, {0: 2, 1: 2}, {0: ref, 1: bad}, {}, (), 0.0, 0.0)
    assert "event #1: rank 1 recorded 'stop' where rank 0 recorded 'sample'" in v.verdict
    v = build_verdict(1, digests, {0: 2, 1: 1}, {0: ref, 1: ref[:1]}, {}, (), 0.0, 0.0)
    assert "rank 1 recorded no more events where rank 0 recorded 'sample'" in v.verdict
    v = build_verdict(1, digests, {0: 1, 1: 2}, {0: ref[:1], 1: ref}, {}, (), 0.0, 0.0)
    assert "event #1 is 'sample' on rank 1 where rank 0 recorded no more events" in v.verdict


def test_to_dict_and_bundle_files_are_json():
    v = verdict_for({0: 42, 1: 17}, missing=(2,))
    doc = v.to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["reason"] == "divergence" and doc["culprit_ranks"] == [1] and doc["step"] == 20
    assert doc["first_difference"]["values"] == {"0": 42, "1": 17}
    assert doc["missing_ranks"] == [2] and doc["detection_latency_seconds"] == 0.5
    files = v.bundle_files()
    assert json.loads(files["consensus/verdict.json"])["verdict"] == v.verdict
    lines = files["consensus/step-20-rank-1.jsonl"].splitlines()
    assert encoding.decode_event(lines[1].encode()) == ("sample", {"tokens": [17, 5]})


def test_keep_lines_bounds_the_logs_but_not_the_diff():
    many = [("e", i) for i in range(50)]
    ref = enc(*many)
    bad = enc(*many[:40], ("e", -1), *many[41:])
    v = build_verdict(0, {0: b"a" * 16, 1: b"b" * 16}, {0: 50, 1: 50}, {0: ref, 1: bad}, {}, (), 0, 0, keep_lines=10)
    assert v.first_difference.index == 40 and len(v.logs[1]) == 10


def test_render_path():
    assert render_path(()) == ""
    assert render_path(("tokens", 0)) == "tokens[0]"
    assert render_path(("args", "n", 2, "x")) == "args.n[2].x"


def test_lists_of_different_lengths_are_described_by_size():
    item = lambda i: [f"req-{i}", 26, 1]  # noqa: E731
    ref = enc(("batch", [item(i) for i in range(4)]))
    short = enc(("batch", [item(i) for i in range(3)]))
    digests = {0: b"a" * 16, 1: b"b" * 16}
    v = build_verdict(21, digests, {0: 1, 1: 1}, {0: ref, 1: short}, {}, (), 0.0, 0.0, in_progress=True)
    assert v.verdict.startswith(
        "rank 1 diverged at step 21 (in progress): event #0 'batch' has 3 items where rank 0 has 4 "
        "(item [3] on rank 0: [\"req-3\",26,1])"
    )
    assert v.to_dict()["step_in_progress"] is True
    nested_ref = enc(("batch", {"ids": ["a", "b"]}))
    nested_long = enc(("batch", {"ids": ["a", "b", "c"]}))
    v = build_verdict(2, digests, {0: 1, 1: 1}, {0: nested_ref, 1: nested_long}, {}, (), 0.0, 0.0)
    assert "event #0 'batch' ids has 3 items where rank 0 has 2 (item [2] on rank 1: \"c\")" in v.verdict


def test_top_level_list_path_reads_naturally():
    v = build_verdict(
        21, {0: b"a" * 16, 1: b"b" * 16}, {0: 1, 1: 1}, {0: enc(("tokens", [119, 5])), 1: enc(("tokens", [120, 5]))},
        {}, (), 0.0, 0.0,
    )
    assert "event #0 'tokens'[0] is 120 where rank 0 has 119" in v.verdict
