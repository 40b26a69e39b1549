"""What a soak watches in every process, and the verdict over what it saw (pure).

``read_process`` reads one process's own accounting from ``/proc`` (resident memory, open file
descriptors); ``parse_metrics`` picks the leak gauges out of a service's Prometheus text
(``pdd_asyncio_tasks``, ``pdd_kv_blocks_used``, ``pdd_fast_link_regions``, ``pdd_engine_requests``).
``verdict`` turns the samples and the request outcomes into the soak's checks: no error but the
cancellations, resident memory flat after warm-up (a restarted process is judged from its own
warm-up on), no growth in descriptors or tasks, and nothing held once the load is gone.
"""

from __future__ import annotations

import os
import statistics
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Gauges read from /metrics; a sample holds each summed over its label sets.
WATCHED = (
    "pdd_asyncio_tasks",
    "pdd_kv_blocks_used",
    "pdd_fast_link_regions",
    "pdd_requests_in_flight",
    "pdd_gateway_in_flight_limit",
)
# Gauges that must be 0 once the load is gone (with ``requests_held``).
HELD_WHEN_IDLE = ("requests_held", "pdd_fast_link_regions", "pdd_requests_in_flight")
REQUESTS_GAUGE = "pdd_engine_requests"


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the soak's load started (negative: the idle baseline)
    process: str
    pid: int
    rss_bytes: int
    open_fds: int
    # Watched gauges (absent for processes without /metrics, e.g. the WAN emulators).
    gauges: Mapping[str, float] = field(default_factory=dict)
    # Open descriptors by kind (``fd_kind``): what a growth in ``open_fds`` is made of.
    fd_kinds: Mapping[str, int] = field(default_factory=dict)


def fd_kind(target: str) -> str:
    """What an /proc/<pid>/fd link points at, as a kind: socket, pipe, eventfd, epoll, shm
    (a /dev/shm file or a memfd), file, or the anon inode's own name."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":", 1)[0]
    if target.startswith("anon_inode:"):
        return target.split(":", 1)[1].strip("[]") or "anon_inode"
    if target.startswith(("/dev/shm/", "/memfd:")):
        return "shm"
    return "file"


def read_process(pid: int) -> tuple[int, int, dict[str, int]]:
    """(resident bytes, open descriptors, descriptors by kind) of ``pid`` from /proc; (0, 0, {})
    once it is gone."""
    kinds: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        names = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0, 0, {}
    for name in names:
        try:
            kind = fd_kind(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:  # NOTE: closed between the listing and the read
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return rss, len(names), kinds


def scrape_metrics(address: str) -> dict[str, float]:
    """``parse_metrics`` of the /metrics at ``address`` (host:port); {} when it cannot be read."""
    if not address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            return parse_metrics(r.read().decode())
    except OSError:
        return {}


def parse_metrics(text: str) -> dict[str, float]:
    """The watched gauges of a Prometheus exposition, each summed over its labels; plus
    ``requests_held``: the engine's running + waiting + paused requests."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in WATCHED:
            out[name] = out.get(name, 0.0) + value
        elif name == REQUESTS_GAUGE:
            out["requests_held"] = out.get("requests_held", 0.0) + value
    return out


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def render_checks(checks: Sequence[Check]) -> str:
    """One line per check: name, ok/FAIL, detail."""
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(f"{c.name:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}" for c in checks)


def _median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else 0.0


def _judged(
    samples: Sequence[Sample], warmup_s: float, since: Mapping[str, float]
) -> dict[str, list[Sample]]:
    """Each process's samples after its warm-up: the soak's, or — for a restarted process (a new
    pid) — its own from ``since[name]`` (when it listened again) on, whichever is later; only its
    last pid's samples, never the idle ones (t < 0)."""
    by: dict[str, list[Sample]] = {}
    for s in sorted(samples, key=lambda s: s.t_s):
        if s.t_s >= 0 and s.rss_bytes:
            by.setdefault(s.process, []).append(s)
    out = {}
    for name, ss in by.items():
        born = {}
        for s in ss:
            born.setdefault(s.pid, s.t_s)
        last_pid = ss[-1].pid
        start = warmup_s
        if len(born) > 1:
            start = max(warmup_s, since.get(name, born[last_pid]) + warmup_s)
        out[name] = [s for s in ss if s.pid == last_pid and s.t_s >= start]
    return out


def _kinds_grown(first: Sample, last: Sample) -> str:
    """The kinds of descriptor that grew between two samples, e.g. `` (socket +9, shm +3)``."""
    grew = {
        k: n - first.fd_kinds.get(k, 0)
        for k, n in last.fd_kinds.items()
        if n > first.fd_kinds.get(k, 0)
    }
    return f" ({', '.join(f'{k} +{d}' for k, d in sorted(grew.items()))})" if grew else ""


def verdict(
    samples: Sequence[Sample],
    outcomes: Mapping[str, int],
    *,
    warmup_s: float,
    rss_growth: float = 0.05,
    fd_slack: int = 2,
    task_slack: int = 2,
    window: int = 3,
    held_at_end: Mapping[str, int] | None = None,
    since: Mapping[str, float] | None = None,
    idle_from_s: float | None = None,
) -> list[Check]:
    """The soak's checks. ``outcomes``: status → count (``completed``, ``cancelled`` and errors);
    ``held_at_end``: engine instance → the soak's requests it still holds once idle; ``since``:
    a restarted process → when it listened again (its warm-up starts there); ``idle_from_s``:
    the samples from then on were taken idle, after the drain (tasks and holdings are judged by
    their least there: a leak stays in every one, a periodic task does not); the last sample
    when None."""
    checks = []
    errors = {k: v for k, v in outcomes.items() if k not in ("completed", "cancelled") and v}
    checks.append(
        Check(
            "errors",
            not errors,
            "none" if not errors else ", ".join(f"{k} {v}" for k, v in errors.items()),
        )
    )
    judged = _judged(samples, warmup_s, since or {})
    grown, short = [], []
    for name, ss in sorted(judged.items()):
        if len(ss) < 2 * window:
            short.append(name)
            continue
        first = _median(s.rss_bytes for s in ss[:window])
        last = _median(s.rss_bytes for s in ss[-window:])
        growth = last / first - 1 if first else 0.0
        if growth > rss_growth:
            grown.append(f"{name} +{growth:.1%}")
    checks.append(
        Check(
            "rss_flat",
            not grown and len(short) < len(judged),
            (", ".join(grown) or f"every process within +{rss_growth:.0%}")
            + (f" (too few samples to judge: {', '.join(short)})" if short else ""),
        )
    )
    fd_grown = []
    for name, ss in sorted(judged.items()):
        if len(ss) >= 2 * window:
            first = _median(s.open_fds for s in ss[:window])
            last = _median(s.open_fds for s in ss[-window:])
            if last > first + fd_slack:
                fd_grown.append(f"{name} {first:g} -> {last:g}{_kinds_grown(ss[0], ss[-1])}")
    checks.append(Check("fds_flat", not fd_grown, ", ".join(fd_grown) or "no growth"))
    # Tasks and holdings: the idle baseline (t < 0) against the idle end (the last sample of each
    # process, taken after the drain), same pid only (a restarted process starts afresh).
    ordered = sorted(samples, key=lambda s: s.t_s)
    idle = {s.process: s for s in ordered if s.t_s < 0}
    end = {s.process: s for s in ordered}
    task_grown, held = [], []
    for name, last in sorted(end.items()):
        ends = [
            s
            for s in ordered
            if s.process == name
            and s.pid == last.pid
            and (s.t_s >= idle_from_s if idle_from_s is not None else s is last)
        ] or [last]

        def least(gauge: str, ends=ends) -> float | None:
            got = [s.gauges[gauge] for s in ends if gauge in s.gauges]
            return min(got) if got else None

        base = idle.get(name)
        tasks = least("pdd_asyncio_tasks")
        if base is not None and tasks is not None and base.pid == last.pid:
            before = base.gauges.get("pdd_asyncio_tasks", 0.0)
            if tasks > before + task_slack:
                task_grown.append(f"{name} {before:g} -> {tasks:g}")
        for gauge in HELD_WHEN_IDLE:
            if (n := least(gauge)) is not None and n > 0:
                held.append(f"{name} {gauge}={n:g}")
    checks.append(Check("tasks_flat", not task_grown, ", ".join(task_grown) or "no growth"))
    for instance, n in sorted((held_at_end or {}).items()):
        if n:
            held.append(f"{instance} holds {n} of the soak's requests")
    checks.append(
        Check("nothing_held", not held, ", ".join(held) or "no request, region or KV held")
    )
    return checks
