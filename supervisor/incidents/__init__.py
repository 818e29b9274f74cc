"""Incident bundles: when and how the supervisor takes evidence, and sharing it across nodes.

``desk`` schedules captures (fatal ones off the main thread, bounded by
``--dump-timeout``; soft ones one after the other), ``error_file`` reads a
rank's own account of its death (torch's ``@record`` file, or the last
traceback on its stderr), ``exchange`` publishes this node's summary of a
multi-node incident and merges the others', ``quarantine`` writes the
incident file the engine names in its 503s, reads the requests rank 0 had in
flight at a fault and quarantines a request that keeps failing the group.
The capture and the bundle format are ``tp_supervise.dumps``'s.  May import
``processes/``, ``nodes/``, the vocabulary, ``dumps``/``watchdogs`` and the
engine's ``runfiles`` (the files it shares with the supervisor); never the
decider.
"""
