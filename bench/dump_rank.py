"""bench/bench_dumps.py's rank: the shared gloo rank program ``tests/fakes/gloo_rank.py``, gloo's timeout 600 s.

    python bench/dump_rank.py RANK WORLD PORT

The program itself (what each rank does, where rank 1 parks) is documented
there; this path runs it with gloo's timeout long enough for every dump of a
rank count, which one parked set of ranks serves.
"""

import runpy
import sys
from pathlib import Path

PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "gloo_rank.py"
GLOO_TIMEOUT_S = 600

if __name__ == "__main__":
    sys.argv = [str(PROGRAM), *sys.argv[1:4], str(GLOO_TIMEOUT_S)]
    runpy.run_path(str(PROGRAM), run_name="__main__")
