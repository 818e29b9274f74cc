"""A torch-free rank that prints (tests of the output pump, supervisor/processes/output_pump.py).

    python chatty_rank.py [--lines N] [--partial] [--bad-bytes] [--progress]
                          [--flood-mb M] [--die-after S] [--raise-on RANK] [--linger S] [--exit CODE]

Prints ``out <rank> <i>`` on stdout and ``err <rank> <i>`` on stderr, N of
each, interleaved.  Then, as asked: a partial line that stays without a
newline (``prompt <rank>> ``) for a second; a line with bytes that are not
UTF-8; a progress bar redrawn with ``\\r``; M MiB of stdout as fast as it can
(every rank but the one in ``--raise-on``); after S seconds, the rank in ``--raise-on`` raises
``RuntimeError("boom 42")`` (no ``@record``), the others block; finally
wait S seconds (so every rank printed before one exits) and exit CODE.
"""

import argparse
import os
import sys
import time


def write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=0)
    p.add_argument("--partial", action="store_true")
    p.add_argument("--bad-bytes", action="store_true")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--flood-mb", type=float, default=0.0)
    p.add_argument("--die-after", type=float, default=None)
    p.add_argument("--raise-on", type=int, default=None)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--linger", type=float, default=0.0, help="seconds to wait before exiting")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for i in range(args.lines):
        write(1, f"out {rank} {i}\n".encode())
        write(2, f"err {rank} {i}\n".encode())
    if args.bad_bytes:
        write(1, b"bad \xff\xfe bytes " + str(rank).encode() + b"\n")
    if args.progress:
        for pct in (10, 50, 100):
            write(2, f"\rprogress {rank} {pct}%".encode())
            time.sleep(0.02)
        write(2, b"\n")
    if args.partial:
        write(1, f"prompt {rank}> ".encode())
        time.sleep(1.0)
        write(1, b"\n")
    if args.flood_mb and rank != args.raise_on:
        line = (f"flood {rank} ".encode() + b"x" * 200)[:199] + b"\n"
        chunk = line * 320
        left = int(args.flood_mb * (1 << 20))
        while left > 0:
            write(1, chunk)
            left -= len(chunk)
    if args.die_after is not None:
        time.sleep(args.die_after)
        if args.raise_on == rank:
            with open(os.environ["CHATTY_DEATH_FILE"], "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("boom 42")
        while True:
            time.sleep(3600)
    time.sleep(args.linger)
    sys.exit(args.exit)


if __name__ == "__main__":
    main()
