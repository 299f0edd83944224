"""The load program: reproduces an action's recorded memory profile inside a sandbox.

It runs with the base image's `python3` (stdlib only, Python 3.11), so it is a script text,
`LOAD_PROGRAM_SOURCE`, and `load_command(...)` wraps it in a `python3 -S -c` shell command.

It reproduces memory, not CPU (traces record none), so it spends as little CPU as it can: a
sped-up replay runs thousands of them on a few cores, and their cost is the same for every
policy. `-S` skips `site`, the result line is formatted by hand (importing `json` pulls in
`re`, a large share of the program's start-up), and each chunk is mapped with MAP_POPULATE,
which faults its pages in one call instead of one fault per page. The
pages are still written afterwards: populate is best effort, and a page it skipped must be
charged all the same.

What it does, with the trace's level semantics (figures include what earlier actions left
resident): the sandbox's resident memory is one file, `<tmp_dir>/tenon-resident.bin`, in a
path the replay declares disposable (a tmpfs at `SCRATCH_DIR`), so it is charged to the
sandbox and vanishes at teardown. With `existing` bytes already in that file, the program
allocates anonymous memory (mmap, writing one byte in every 4096 so each page is really
resident) following

    ramp 0 -> peak - existing over 10% of the duration, hold the peak for 10%, then a level
    chosen so the time-average over the whole duration is avg - existing,

frees it, and finally grows or shrinks the resident file to `resident_after_bytes` (writing
real bytes; a sparse file would cost nothing). It prints one JSON line and exits 0.
When avg is far below peak the level after the peak is 0 and the hold is shortened; a very
short duration may be exceeded by the time it takes to touch the pages.
"""

from __future__ import annotations

import logging
import shlex
from typing import Final

logger = logging.getLogger(__name__)

RESIDENT_FILE_NAME: Final = "tenon-resident.bin"

LOAD_PROGRAM_SOURCE: Final = r'''
import mmap, os, sys, time

PAGE = 4096
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def level_at(t, d, anon_avg, anon_peak):
    """Target anonymous bytes at time t of d: ramp, hold the peak, then a level."""
    if anon_peak <= 0 or d <= 0:
        return anon_peak
    ramp, hold = 0.1 * d, 0.1 * d
    rest = d - ramp - hold
    level = (anon_avg * d - anon_peak * (ramp / 2 + hold)) / rest
    if level < 0:
        level = 0.0
        hold = max(0.0, anon_avg * d / anon_peak - ramp / 2)
    if t < ramp:
        return anon_peak * t / ramp
    if t < ramp + hold:
        return anon_peak
    return min(anon_peak, level)


def main(argv):
    avg, peak, duration = int(argv[1]), int(argv[2]), float(argv[3])
    resident_after, tmp_dir = int(argv[4]), argv[5]
    os.makedirs(tmp_dir, exist_ok=True)
    path = os.path.join(tmp_dir, "tenon-resident.bin")
    existing = os.path.getsize(path) if os.path.exists(path) else 0
    anon_peak = max(0, peak - existing)
    anon_avg = max(0, min(avg - existing, anon_peak))
    chunk = max(PAGE, min(16 << 20, (anon_peak // 64) // PAGE * PAGE or PAGE))
    chunks = []
    held = reached = 0
    start = time.monotonic()
    while True:
        t = time.monotonic() - start
        if t >= duration and reached >= anon_peak:
            break
        target = level_at(t, duration, anon_avg, anon_peak)
        if reached < anon_peak and t >= 0.1 * duration:
            target = anon_peak
        while held < anon_peak and (held + chunk // 2 <= target or target >= anon_peak):
            size = min(chunk, anon_peak - held)
            area = mmap.mmap(-1, size, flags=FLAGS)
            area[::PAGE] = b"\x01" * len(range(0, size, PAGE))
            chunks.append(area)
            held += size
        while chunks and held - len(chunks[-1]) >= target:
            held -= len(chunks[-1])
            chunks.pop().close()
        reached = max(reached, held)
        time.sleep(0.005)
    for area in chunks:
        area.close()
    chunks.clear()
    with open(path, "ab") as out:
        if resident_after < existing:
            out.truncate(resident_after)
        block = b"\x02" * (1 << 20)
        remaining = resident_after - existing
        while remaining > 0:
            out.write(block[:remaining])
            remaining -= len(block)
    elapsed = time.monotonic() - start
    print('{"anon_peak_bytes": %d, "resident_bytes": %d, "elapsed_s": %.3f}'
          % (reached, os.path.getsize(path), elapsed))
    return 0


sys.exit(main(sys.argv))
'''


# Where the load program keeps the memory it leaves resident: a path the replay declares
# disposable in the sandbox configuration (a fresh tmpfs at every materialization).
SCRATCH_DIR: Final = "/scratch"


def load_command(
    avg_bytes: int,
    peak_bytes: int,
    duration_s: float,
    resident_after_bytes: int,
    tmp_dir: str = SCRATCH_DIR,
    *,
    python: str = "python3",
) -> str:
    """A shell command that runs the load program for one action's profile."""
    if min(avg_bytes, peak_bytes, resident_after_bytes) < 0 or duration_s < 0:
        raise ValueError("load_command: sizes and duration must not be negative")
    if peak_bytes < avg_bytes:
        raise ValueError(f"load_command: peak_bytes {peak_bytes} < avg_bytes {avg_bytes}")
    args = [
        python,
        "-S",
        "-c",
        LOAD_PROGRAM_SOURCE,
        str(int(avg_bytes)),
        str(int(peak_bytes)),
        f"{duration_s:.3f}",
        str(int(resident_after_bytes)),
        tmp_dir,
    ]
    return shlex.join(args)
