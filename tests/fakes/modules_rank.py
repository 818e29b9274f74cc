"""A rank that reports what it has loaded: ``python modules_rank.py OUT [--torch]``.

With ``--torch``: a plain zero-code torch.distributed program (gloo init, one
all_reduce).  Without: no torch at all (any interpreter will do).  Writes
``OUT/rank-<RANK>.json`` with the sorted ``sys.modules`` and, for each
tp_supervise module, the file it was loaded from.
"""

import json
import os
import sys


def main() -> None:
    out = sys.argv[1]
    if "--torch" in sys.argv:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.destroy_process_group()
    ours = {name: getattr(mod, "__file__", None) for name, mod in list(sys.modules.items())
            if name.startswith("tp_supervise")}
    with open(os.path.join(out, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"modules": sorted(sys.modules), "ours": ours}, f)


if __name__ == "__main__":
    main()
