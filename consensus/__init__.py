"""Rank consensus: catch ranks that disagree at the step they diverge.

Rank side (imported by ranks, torch-free): ``consensus.rank`` (``record``,
``end_step``, ``@rank_consensus``).  Transport: ``consensus.ring`` (one
shared-memory digest ring per rank).  Supervisor side: ``consensus.monitor``
(``ConsensusMonitor.poll``), over the pure ``consensus.compare`` and
``consensus.verdict``.  ``consensus.channel.rank_env`` is the environment the
supervisor gives each rank.  ``consensus.inband`` is the in-band baseline the
benchmark compares against.  See docs/consensus.md.
"""
