"""A node whose ranks all wait asks the other nodes where the missing rank is (supervisor/multinode.py
``ask_where``), with an engine that compiles its model too (issue 43): its ranks wait in collectives the hook
cannot see, so they show as inside a step, outside collectives.  The decision is pure; the link only records."""

from __future__ import annotations

from dataclasses import replace

from tests.watchdogs.wdfakes import Driver, SteadyGroup, snap
from tp_supervise.supervisor.events import WatchdogVerdict
from tp_supervise.supervisor.multinode import GroupOfNodes
from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions
from tp_supervise.supervisor.state import AttemptCase
from tp_supervise.watchdogs.policy import WatchdogConfig


class Link:
    def __init__(self):
        self.asked = []

    def ask_where(self, query):
        self.asked.append(query)


def node(command: tuple[str, ...]) -> tuple[GroupOfNodes, Link]:
    spec = LaunchSpec(command=command, nproc_per_node=1, tree=True, zero_code_hook=False,
                      metrics=MetricsOptions(addr=None), nnodes=2, node_rank=0, master_port=29500)  # fmt: skip
    link = Link()
    return GroupOfNodes(spec, "20261207T120000Z-abcdef", link, None), link  # type: ignore[arg-type]


def hard(**fields) -> WatchdogVerdict:
    group, driver = SteadyGroup(nranks=1), Driver(WatchdogConfig(soft_timeout=3.0, hard_timeout=6.0))
    verdict = None
    for _ in range(3):
        verdict = driver.tick(group.advance(0.05))
    verdict = replace(verdict, **fields)
    return WatchdogVerdict(verdict.kind, 6.0, "hang", verdict, (snap(0, step=40, in_step=True),), 100.0)


COMPILED = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "-tp", "2", "--nnodes", "2")
EAGER = (*COMPILED, "--enforce-eager")


def test_a_compiled_engines_ranks_inside_a_step_ask_by_step():
    rules, link = node(COMPILED)
    ev = hard(outside_collective=(0,), outside_in_step=(0,), in_collective=(), max_step=40)
    hold = rules.ask_where(ev, AttemptCase(), 1, 100.0)
    assert hold is not None and len(link.asked) == 1
    query = link.asked[0]
    assert (query.seq, query.inside_step, query.node) == (40, True, 0)


def test_in_eager_mode_a_rank_outside_collectives_is_this_nodes_evidence():
    rules, link = node(EAGER)
    ev = hard(outside_collective=(0,), outside_in_step=(0,), in_collective=(), max_step=40)
    assert rules.ask_where(ev, AttemptCase(), 1, 100.0) is None and link.asked == []


def test_a_compiled_engines_rank_outside_any_step_or_stopped_here_is_ruled_here():
    rules, link = node(COMPILED)
    idle = hard(outside_collective=(0,), outside_in_step=(), in_collective=(), max_step=40)
    assert rules.ask_where(idle, AttemptCase(), 1, 100.0) is None
    stopped = hard(outside_collective=(0,), outside_in_step=(0,), in_collective=(), elsewhere_ranks=(0,))
    assert rules.ask_where(stopped, AttemptCase(), 1, 100.0) is None
    assert link.asked == []
