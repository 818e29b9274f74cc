"""Multi-node mechanism: one supervisor per node, node 0 hosts the store.

``store`` (the ``Store`` interface and its TCPStore implementation, every call
timed and bounded), ``handshake`` (registration, validation, start barrier),
``messages`` (what travels between supervisors, decoded and validated in one
place) and ``link`` (the node-link thread: beats, the fault bus, liveness).
Keys and the trust model are in docs/multinode.md.  May import ``rank/`` and
the vocabulary; never the decider, ``processes/``, ``observers/`` or
``incidents/``.
"""
