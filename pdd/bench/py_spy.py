"""Where a process's CPU time goes: ``py-spy record`` attached to running processes.

``pdd bench served --py-spy PATH`` profiles every stack process over its measured rounds;
``top_frames`` reduces py-spy's raw (collapsed) stacks to the functions with most self time.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


class PySpy:
    """``--py-spy``: one ``py-spy record`` per stack process over the measured rounds.

    NOTE: py-spy samples only threads that are running (not waiting), so a process's samples
    are where its CPU time goes; ``--nonblocking`` keeps it from pausing the process to read.
    """

    def __init__(self, py_spy: str, pids: Mapping[str, Sequence[int]], out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.files = {name: out_dir / f"{name}.txt" for name in pids}
        self.procs = [
            subprocess.Popen(
                [py_spy, "record", "--pid", str(group[0]), "--rate", "200", "--nonblocking"]
                + ["--format", "raw", "--output", str(self.files[name])],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, group in pids.items()
        ]

    def stop(self) -> dict[str, list[tuple[str, float, float]]]:
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        return {n: top_frames(f.read_text()) for n, f in self.files.items() if f.is_file()}


def top_frames(raw: str, n: int = 12) -> list[tuple[str, float, float]]:
    """py-spy's raw (collapsed) stacks → the ``n`` functions with most self time:
    (function, self share, inclusive share) of all samples."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f.strip() for f in stack.split(";")]  # outermost first
        k = int(count)
        total += k
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    top = sorted(own, key=own.__getitem__, reverse=True)[:n]
    return [(f, own[f] / total, incl[f] / total) for f in top] if total else []
