"""A rank that died of our own code gets a verdict that says so, and the bundle keeps the traceback (issue 43).

A real rank under ``supervise serve``: it joins a gloo group and compiles, with ``fullgraph=True``, a function
that calls the rank-side runtime API (``runtime.begin_collective``: the instrumented way, which is for eager code;
the zero-code hook's wrappers are inert under the compiler, this explicit call is not).  torch.compile refuses our
slot writer's lock and the rank dies: exit 80, and the verdict names the hook and where it was entered, not the
program.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

RANK = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from tp_supervise.supervisor.rank import runtime

    dist.init_process_group("gloo")

    def forward(x):
        runtime.begin_collective("my_all_reduce")
        return x * 2

    torch.compile(forward, fullgraph=True)(torch.ones(2))
    """
)


def test_a_rank_that_died_in_our_code_is_the_hooks_fault_in_the_verdict(supervise, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    run = supervise(["--nproc-per-node", "1"], [sys.executable, str(script)])
    assert run.wait(timeout=180) == 80, run.stderr[-4000:]
    summary = run.summary("-rank_exit")
    assert "tp-supervise's own hook, not of the engine" in summary["verdict"], summary["verdict"]
    fault = summary["hook_fault"]
    assert fault["entered_from"].startswith("rank.py:") and fault["entered_from"].endswith("in forward")
    assert fault["wrapper"].startswith("runtime.py:") and "begin_collective" in fault["wrapper"]
    assert "from user code:" in fault["traceback"]
    assert summary["error"]["source"] == "stderr"
