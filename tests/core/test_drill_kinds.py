"""The drill's kinds: selection by name, family and role, and the score of a trial against what a kind expects."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tp_supervise.supervisor.drills.command import ALIASES, parse_kinds
from tp_supervise.supervisor.drills.kinds import BY_NAME, KINDS, KindError, Observed, score, select


def test_the_campaign_has_twenty_kinds_on_one_node_and_every_role():
    one_node = [k for k in KINDS if k.nodes == 1]
    assert len(one_node) >= 20
    assert {k.role for k in one_node} == {"rank", "scheduler", "frontend"}
    assert {"signal", "stuck", "collective", "exit", "memory", "straggler", "control", "environment"} <= {
        k.family for k in one_node
    }
    for k in KINDS:  # every kind says how it is made
        assert sum(x is not None for x in (k.signum, k.lane, k.cpu_share)) + bool(k.environment) + (k.nodes > 1) >= 1


def test_kinds_are_chosen_by_name_family_and_role():
    assert [k.name for k in select("signal", "frontend")] == ["kill_frontend", "segv_frontend", "abort_frontend",
                                                              "stop_frontend"]  # fmt: skip
    assert [k.name for k in select("stuck_scheduler,stuck", None)][:2] == ["stuck_scheduler", "stuck_python"]
    assert [k.name for k in parse_kinds("kill,stop")] == ["kill_rank", "stop_rank"]  # the former names
    assert set(ALIASES.values()) <= set(BY_NAME)
    for kinds, roles in (("meteor", None), ("signal", "wizard"), ("oom", "frontend")):
        with pytest.raises(KindError):
            select(kinds, roles)


def test_a_trial_is_scored_against_the_kind():
    stop = BY_NAME["stop_rank"]
    right = Observed(reason="hang", culprit_role="rank", culprit_rank=1, restarted=True, verdict="rank 1 ...")
    assert score(stop, right) == (True, True, "")
    wrong = Observed(reason="hang", culprit_role="rank", culprit_rank=0, restarted=True)
    localised, passed, why = score(stop, wrong)
    assert not localised and not passed and "named rank 0, expected rank 1" in why
    harmed = Observed(reason="hang", culprit_role="rank", culprit_rank=1, restarted=True, client_errors=2)
    assert score(stop, harmed)[:2] == (True, False)
    oom = BY_NAME["oom"]
    said = Observed(reason="rank_exit", culprit_role="rank", culprit_rank=1, restarted=True, verdict="killed by SIGKILL")
    assert "OOM" in score(oom, said)[2], "the OOM kind wants the verdict to say so"
    quiet = BY_NAME["shm_full"]
    assert score(quiet, Observed(restarted=True))[:2] == (True, True)
    assert score(quiet, Observed(reason="rank_exit", culprit_role="rank", culprit_rank=1, restarted=True))[1] is False
    fatal = BY_NAME["exception"]  # either verdict, as long as rank 1 is named
    assert score(fatal, Observed(reason="rank_exit", culprit_role="rank", culprit_rank=1, restarted=True))[1]
    assert score(fatal, Observed(reason="hang", culprit_role="rank", culprit_rank=1, restarted=True))[1]


def test_list_kinds_prints_every_kind_without_a_command():
    done = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--list-kinds"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert all(k.name in done.stdout for k in KINDS)
