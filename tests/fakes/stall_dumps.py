"""`supervise`, with a dump directory that can be made to block every bundle write.

    python stall_dumps.py serve [OPTIONS] [-- COMMAND ...]     (the arguments of `supervise`)

While a FIFO named ``stall.fifo`` exists in the dump directory, the bundle
writer opens it for writing before anything else; nobody ever opens it for
reading, so that open(2) sleeps in the kernel for ever, as a write to a hung
NFS server would.  The test creates the FIFO once the run is up.  For hosts
where tests cannot mount a filesystem that really blocks (see
tests/e2e/test_dump_deadline.py); nothing else differs from `supervise`.
"""

import os
import sys

from tp_supervise.dumps import bundle
from tp_supervise.supervisor.cli import main

STALL_FIFO = "stall.fifo"
_write = bundle.BundleWriter.write


def stalled_write(self, *args, **kwargs):
    fifo = os.path.join(self.dump_dir, STALL_FIFO)
    if os.path.exists(fifo):
        with open(fifo, "wb"):  # blocks: no reader ever comes
            pass
    return _write(self, *args, **kwargs)


bundle.BundleWriter.write = stalled_write

if __name__ == "__main__":
    sys.exit(main())
