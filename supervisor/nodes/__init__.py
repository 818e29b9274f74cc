"""Multi-node mechanism: one supervisor per node, node 0 hosts the store.

``store`` (the ``Store`` interface and its TCPStore implementation, every call
timed and bounded by a deadline enforced outside the call), ``store_host``
(node 0's store in a child process, loopback only, memory-capped),
``wire`` (the authenticated wire: hello, challenge-response, MACed frames),
``gate`` (node 0's one public port: store tunnels and node links behind it),
``tunnel`` (the other nodes' side of it), ``transport`` (which of these a node
runs), ``handshake`` (registration, validation, start barrier), ``join`` (store then handshake, at the start of the run), ``messages``
(what travels between supervisors, decoded and validated in one place) and
``link`` (the node-link thread: beats, the fault bus, liveness).
Keys and the trust model are in docs/multinode.md.  May import ``rank/``, the
vocabulary and ``processes/pidfds`` (the store host is one of the supervisor's
own helpers, which no teardown signals); never the decider, ``observers/`` or
``incidents/``.
"""
