"""Rank consensus, supervisor side: catch ranks that disagree at the step they diverge.

Here: ``consensus.monitor`` (``ConsensusMonitor.poll``, reads the rings),
over the pure ``consensus.compare`` and ``consensus.verdict``.  What runs in
the ranks lives in the rank-side package ``tp_supervise.supervisor.rank``:
the recorder (``consensus``: ``record``, ``end_step``, ``@rank_consensus``),
the canonical encoding and digests (``encoding``), the shared-memory digest
ring, one per rank (``ring``), the environment contract (``channel``) and the
in-band baseline the benchmark compares against (``inband``).  See
docs/consensus.md.
"""
