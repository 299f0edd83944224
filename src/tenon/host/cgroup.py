"""One sandbox's cgroup: readings, limits, the freezer gate, kill and remove (v1 and v2)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tenon.errors import CgroupUnavailable, ConfigError, HostError
from tenon.host.cgroupfs import (
    keyed_value,
    read_int,
    read_keyed,
    read_raw,
    read_raw_if_present,
    read_text,
)
from tenon.host.layout import CgroupLayout
from tenon.host.psi import read_pressure
from tenon.host.types import CgroupVersion, GateResult, MemoryReading, PressureReading

logger = logging.getLogger(__name__)

UNLIMITED_V1_BYTES = 1 << 62  # v1 reports "no limit" as a huge page-aligned number
FREEZE_TIMEOUT_S = 5.0
_POLL_S = 0.0005
_V1_FROZEN, _V1_THAWED = "FROZEN", "THAWED"  # "FREEZING" is the transition in between


_NUMBER_READ_BYTES = 64  # a single-number file (usage in bytes, cpuacct.usage in ns)
_STAT_READ_BYTES = 4096  # v2 cpu.stat, whose first line is usage_usec
# The files `sample` keeps open: usage, swap (-1 where not accounted apart), CPU; and
# whether CPU is v1 cpuacct.usage (one number, ns) rather than v2 cpu.stat (keyed, us).
_SampleFds = tuple[int, int, int, bool]


def _read_sample(fds: _SampleFds) -> tuple[int, float]:
    """(usage_bytes, cpu_usage_s) re-read through kept descriptors: pread(2) at offset 0
    makes a cgroupfs file generate its content afresh."""
    usage_fd, swap_fd, cpu_fd, cpu_v1 = fds
    usage = int(os.pread(usage_fd, _NUMBER_READ_BYTES, 0))
    if swap_fd >= 0:
        usage += int(os.pread(swap_fd, _NUMBER_READ_BYTES, 0))
    if cpu_v1:
        return usage, int(os.pread(cpu_fd, _NUMBER_READ_BYTES, 0)) / 1e9
    for line in os.pread(cpu_fd, _STAT_READ_BYTES, 0).splitlines():  # usage_usec comes first
        if line.startswith(b"usage_usec "):
            return usage, int(line.split()[1]) / 1e6
    return usage, 0.0


def _close_fds(fds: _SampleFds | None) -> None:
    if fds is not None:
        for fd in fds[:3]:
            if fd >= 0:
                os.close(fd)


# Descriptors kept open by every `sample` in the process, at most `_max_kept_fds()`: past
# that a sample opens, reads and closes, so keeping files never exhausts RLIMIT_NOFILE
# (a service's default soft limit is often 1,024) for other work or for the samples.
_kept_lock = threading.RLock()  # reentrant: `__del__` may release from inside a reserve
_num_kept_fds = 0


def _max_kept_fds() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (1 << 20) if soft == resource.RLIM_INFINITY else soft // 2


def _num_open(fds: _SampleFds) -> int:
    return sum(fd >= 0 for fd in fds[:3])


def _reserve_count(num_fds: int) -> bool:
    global _num_kept_fds
    max_fds = _max_kept_fds()
    with _kept_lock:
        if _num_kept_fds + num_fds > max_fds:
            return False
        _num_kept_fds += num_fds
        return True


def _release_count(num_fds: int) -> None:
    global _num_kept_fds
    with _kept_lock:
        _num_kept_fds -= num_fds


def _reserve_kept(fds: _SampleFds) -> bool:
    return _reserve_count(_num_open(fds))


def _release_kept(fds: _SampleFds | None) -> None:
    if fds is not None:
        _release_count(_num_open(fds))
        _close_fds(fds)


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup: a directory per v1 controller, or one v2 directory."""

    sandbox_id: str
    layout: CgroupLayout
    dirs: dict[str, Path]  # controller -> directory (v2: every controller -> the same dir)
    _seen_oom_kills: int = field(default=0)
    _sample_paths: tuple[str, str, str] | None = field(default=None, repr=False, compare=False)
    # The sampled files, kept open (usage, swap or -1, cpu); `close` and `remove` close them.
    _sample_fds: _SampleFds | None = field(default=None, repr=False, compare=False)
    _fds_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _held_since: float | None = field(default=None, repr=False, compare=False)
    _held_total_s: float = field(default=0.0, repr=False, compare=False)
    # v2: memory.peak opened and reset by `reset_peak`; the kernel keeps a reset per open
    # file, so readings take the peak through this descriptor while it is open.
    _peak_fd: int = field(default=-1, repr=False, compare=False)

    @property
    def _v1(self) -> bool:
        return self.layout.version is CgroupVersion.V1

    @property
    def v2_dir(self) -> Path | None:
        """The sandbox's one cgroup v2 directory (the sched_ext gate keys on its inode number);
        None on v1."""
        return None if self._v1 else next(iter(self.dirs.values()), None)

    def _dir(self, controller: str) -> Path:
        try:
            return self.dirs[controller]
        except KeyError:
            raise CgroupUnavailable(
                f"controller {controller} is not available for {self.sandbox_id} "
                f"({'; '.join(self.layout.missing) or 'not in this layout'})"
            ) from None

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs.values())

    def procs_files(self) -> list[Path]:
        """Every cgroup.procs a new process must be written into (one per v1 hierarchy)."""
        return sorted({d / "cgroup.procs" for d in self.dirs.values()})

    def add_pid(self, pid: int) -> None:
        for procs in self.procs_files():
            self.layout.io.write(procs, str(pid))

    def pids(self) -> list[int]:
        """Processes in the cgroup (from the memory controller's view)."""
        # A leftover may lack the memory hierarchy (v1); any hierarchy lists its tasks.
        views = [self.dirs[c] for c in sorted(self.dirs, key=lambda c: c != "memory")]
        view = next((d for d in views if d.is_dir()), None) or self._dir("memory")
        return [int(p) for p in read_text(view / "cgroup.procs").split()]

    def set_max_pids(self, max_pids: int | None) -> None:
        """Cap the number of tasks (None = unlimited)."""
        if max_pids is not None and max_pids < 1:
            raise ConfigError(f"max_pids must be at least 1, got {max_pids}")
        value = "max" if max_pids is None else str(max_pids)
        self.layout.io.write(self._dir("pids") / "pids.max", value)

    def set_cpu_quota(self, fraction: float | None) -> None:
        """Cap CPU time at `fraction` of one CPU per period (2.0 = two CPUs; None = unlimited)."""
        if fraction is not None and not fraction > 0:
            raise ConfigError(f"cpu quota must be a positive fraction of a CPU, got {fraction}")
        cpu = self._dir("cpu")
        if self._v1:
            period_us = read_int(cpu / "cpu.cfs_period_us")
            quota_us = -1 if fraction is None else max(1000, round(fraction * period_us))
            self.layout.io.write(cpu / "cpu.cfs_quota_us", str(quota_us))
            return
        period_us = int(read_text(cpu / "cpu.max").split()[1])
        quota = "max" if fraction is None else str(max(1000, round(fraction * period_us)))
        self.layout.io.write(cpu / "cpu.max", f"{quota} {period_us}")

    def set_memory_high(self, high_bytes: int | None) -> None:
        """v2 memory.high: throttle and reclaim above it (None = max). v1 has no equivalent."""
        if self._v1:
            raise CgroupUnavailable("memory.high needs cgroup v2; v1 has only hard limits")
        if high_bytes is not None and high_bytes < 0:
            raise ConfigError(f"memory.high must not be negative, got {high_bytes}")
        value = "max" if high_bytes is None else str(high_bytes)
        self.layout.io.write(self._dir("memory") / "memory.high", value)

    def set_oom_group(self, enabled: bool) -> None:
        """v2 memory.oom.group: an OOM kill that picks a process in this cgroup kills every
        process in it, not only the largest. v1 kills one process only."""
        if self._v1:
            raise CgroupUnavailable("memory.oom.group needs cgroup v2; v1 kills one process")
        self.layout.io.write(self._dir("memory") / "memory.oom.group", "1" if enabled else "0")

    def reading(self) -> MemoryReading:
        # Bare os reads on string paths: the execution loop takes the domain's reading every
        # period, through a fresh object each time (pathlib costs more than the reads).
        mem = str(self._dir("memory"))
        if self._v1:
            limit = int(read_raw(f"{mem}/memory.limit_in_bytes"))
            cpu_s = int(read_raw(f"{self._dir('cpuacct')}/cpuacct.usage")) / 1e9
            ooms = keyed_value(read_raw(f"{mem}/memory.oom_control"), b"oom_kill")
            usage = read_raw_if_present(f"{mem}/memory.memsw.usage_in_bytes")
            if usage is None:
                usage = read_raw(f"{mem}/memory.usage_in_bytes")
            peak = read_raw_if_present(f"{mem}/memory.memsw.max_usage_in_bytes")
            if peak is None:
                peak = read_raw(f"{mem}/memory.max_usage_in_bytes")
            return MemoryReading(int(usage), int(peak),
                                 None if limit >= UNLIMITED_V1_BYTES else limit, cpu_s, ooms)
        usage_bytes = int(read_raw(f"{mem}/memory.current"))
        swap = read_raw_if_present(f"{mem}/memory.swap.current")
        if swap is not None:
            usage_bytes += int(swap)
        peak = self._read_reset_peak()
        if peak is None:
            peak = read_raw_if_present(f"{mem}/memory.peak")  # absent before Linux 5.19
        peak_bytes = usage_bytes if peak is None else max(int(peak), usage_bytes)
        limit_text = read_raw(f"{mem}/memory.max").strip()
        # cpu.stat is present even when the cpu controller is not enabled
        cpu_stat = read_raw_if_present(f"{mem}/cpu.stat")
        cpu_s = 0.0 if cpu_stat is None else keyed_value(cpu_stat, b"usage_usec") / 1e6
        ooms = keyed_value(read_raw(f"{mem}/memory.events"), b"oom_kill")
        max_bytes = None if limit_text == b"max" else int(limit_text)
        return MemoryReading(usage_bytes, peak_bytes, max_bytes, cpu_s, ooms)

    def reset_peak(self) -> bool:
        """Restart the high-water mark at the current usage, so the next reading's peak is
        this action's own. True if it was reset; False (the caller keeps the mark it had)
        where the kernel cannot, or the cgroup is gone.

        v1 resets on a write of 0. v2's memory.peak (Linux 6.12 and later) resets only for
        the open file that wrote it: this cgroup keeps that file open, and `reading` takes
        the peak through it until `close` or `remove`."""
        if not self._v1:
            return self._reset_v2_peak()
        mem = self._dir("memory")
        reset = False
        for name in ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes"):
            path = mem / name
            if path.exists():
                try:
                    self.layout.io.write(path, "0")
                    reset = True
                except OSError as exc:
                    logger.debug("cannot reset %s: %s", path, exc)
        return reset

    def _reset_v2_peak(self) -> bool:
        path = self._dir("memory") / "memory.peak"
        with self._fds_lock:
            self._close_peak_fd()
            try:
                fd = self.layout.io.open_reset(path)
            except OSError as exc:  # a kernel before 6.12 (read-only), or the cgroup is gone
                logger.debug("cannot reset %s: %s", path, exc)
                return False
            if not _reserve_count(1):
                os.close(fd)
                return False
            self._peak_fd = fd
            return True

    def _read_reset_peak(self) -> bytes | None:
        """memory.peak through the descriptor `reset_peak` left open, or None without one
        (or once its cgroup is gone: the path decides afresh)."""
        with self._fds_lock:
            if self._peak_fd < 0:
                return None
            try:
                return os.pread(self._peak_fd, _NUMBER_READ_BYTES, 0)
            except OSError:
                self._close_peak_fd()
                return None

    def _close_peak_fd(self) -> None:
        fd, self._peak_fd = self._peak_fd, -1
        if fd >= 0:
            _release_count(1)
            os.close(fd)

    def sample(self) -> tuple[int, float]:
        """(usage_bytes, cpu_usage_s): the two figures the execution loop needs each period.

        The hot path: with 100 sandboxes sampled every 100 ms this runs 1,000 times a second.
        It keeps its files open and re-reads them with pread(2) at offset 0, where a cgroupfs
        file generates its content afresh: opening walks the path and costs several times the
        read itself (`reading()` opens its five files each time and is for everything else).
        """
        with self._fds_lock:
            if self._sample_fds is not None:
                try:
                    return _read_sample(self._sample_fds)
                except OSError:
                    # A kept descriptor fails (ENODEV) once its cgroup is removed, also when
                    # a cgroup of the same name took its place: the paths decide, afresh.
                    self._close_sample_fds()
            try:
                fds = self._open_sample_fds()
                if not _reserve_kept(fds):
                    try:
                        return _read_sample(fds)
                    finally:
                        _close_fds(fds)
                self._sample_fds = fds
                return _read_sample(fds)
            except OSError as exc:
                self._close_sample_fds()
                raise HostError(f"cannot sample cgroup of {self.sandbox_id}: {exc}") from exc

    def _open_sample_fds(self) -> _SampleFds:
        paths = self._sample_paths
        if paths is None:
            paths = self._sample_paths = self._resolve_sample_paths()
        fds: list[int] = []
        try:
            for path in paths:
                fds.append(os.open(path, os.O_RDONLY) if path else -1)
        except OSError:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            raise
        return fds[0], fds[1], fds[2], self._v1

    def _close_sample_fds(self) -> None:
        fds, self._sample_fds = self._sample_fds, None
        _release_kept(fds)

    def close(self) -> None:
        """Close the files `sample` and `reset_peak` keep open (idempotent; a later sample
        reopens its files; the peak is the cgroup's whole high-water mark again)."""
        with self._fds_lock:
            self._close_sample_fds()
            self._close_peak_fd()

    def __del__(self) -> None:
        # A cgroup object dropped without `remove` or `close` (say, replaced on re-adoption)
        # must not hold its descriptors until the process exits.
        _release_kept(getattr(self, "_sample_fds", None))
        peak_fd = getattr(self, "_peak_fd", -1)
        if peak_fd >= 0:
            _release_count(1)
            os.close(peak_fd)

    def _resolve_sample_paths(self) -> tuple[str, str, str]:
        mem = self._dir("memory")
        if self._v1:
            usage = mem / "memory.memsw.usage_in_bytes"
            if not usage.exists():
                usage = mem / "memory.usage_in_bytes"
            return str(usage), "", str(self._dir("cpuacct") / "cpuacct.usage")
        swap = mem / "memory.swap.current"
        return (str(mem / "memory.current"), str(swap) if swap.exists() else "",
                str(mem / "cpu.stat"))

    def pressure(self) -> PressureReading | None:
        """This cgroup's memory PSI (v2 only; None on v1 or without PSI)."""
        if self._v1:
            return None
        return read_pressure(self._dir("memory") / "memory.pressure")

    def new_oom_kills(self) -> int:
        """OOM kills in this cgroup since the previous call."""
        total = self.reading().num_oom_kills
        fresh, self._seen_oom_kills = total - self._seen_oom_kills, total
        return max(fresh, 0)

    def is_frozen(self) -> bool:
        if self._v1:
            return read_text(self._dir("freezer") / "freezer.state").strip() == _V1_FROZEN
        return read_keyed(self._dir("memory") / "cgroup.events").get("frozen", 0) == 1

    def _freeze_requested(self) -> bool:
        """Whether a freeze is asked for, settled or not (v1 FREEZING or FROZEN; v2
        cgroup.freeze). It can differ from `is_frozen`: a v2 cgroup whose tasks are dying
        (cgroup.kill) or are still stopping shows frozen 0 while the request stays."""
        if self._v1:
            return read_text(self._dir("freezer") / "freezer.state").strip() != _V1_THAWED
        return read_text(self._dir("memory") / "cgroup.freeze").strip() == "1"

    def _set_frozen(self, frozen: bool, timeout_s: float) -> GateResult:
        start = time.perf_counter()
        # Unchanged only when both the request and the state match: a thaw that saw a
        # transient "not frozen" and wrote nothing would leave the request standing, and the
        # cgroup frozen again (with whatever enters it next) once the transition settles.
        if self._freeze_requested() == frozen and self.is_frozen() == frozen:
            return GateResult(frozen, False, time.perf_counter() - start)
        if self._v1:
            target = self._dir("freezer") / "freezer.state"
            self.layout.io.write(target, _V1_FROZEN if frozen else _V1_THAWED)
        else:
            target = self._dir("memory") / "cgroup.freeze"
            self.layout.io.write(target, "1" if frozen else "0")
        while self.is_frozen() != frozen:
            if time.perf_counter() - start > timeout_s:
                raise HostError(f"cgroup of {self.sandbox_id} did not reach frozen={frozen} "
                                f"within {timeout_s} s after writing {target}")
            time.sleep(_POLL_S)
        elapsed_s = time.perf_counter() - start
        logger.debug("sandbox %s frozen=%s in %.4f s", self.sandbox_id, frozen, elapsed_s)
        return GateResult(frozen, True, elapsed_s)

    def freeze(self, timeout_s: float = FREEZE_TIMEOUT_S) -> GateResult:
        """Deny execution: the cgroup's processes stop (idempotent).

        The hold counts from the request, also when the transition has not settled within
        `timeout_s` (HostError; the kernel finishes it): counting only settled freezes would
        charge an exec whose freeze is slow (runc mid-setup) for all its held time against
        its timeout, and it could time out while frozen.
        """
        if self._held_since is None:
            self._held_since = time.monotonic()
        return self._set_frozen(True, timeout_s)

    def thaw(self, timeout_s: float = FREEZE_TIMEOUT_S) -> GateResult:
        """Allow execution again (idempotent); the hold ends with the request."""
        self.note_held(False)
        return self._set_frozen(False, timeout_s)

    def note_held(self, held: bool) -> None:
        """Start or end the hold clock for a hold made without the freezer (the sched_ext
        gate), so that `held_s` counts it too (idempotent)."""
        if held and self._held_since is None:
            self._held_since = time.monotonic()
        elif not held and self._held_since is not None:
            self._held_total_s += time.monotonic() - self._held_since
            self._held_since = None

    def held_s(self) -> float:
        """Seconds this cgroup has been held (frozen through `freeze()`, or by the sched_ext
        gate through `note_held`), in total so far.

        An action's timeout counts its running time only: time the gate held it is the
        controller's doing, not the command's.
        """
        current = 0.0 if self._held_since is None else time.monotonic() - self._held_since
        return self._held_total_s + current

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process until the cgroup is empty (its descendants' too on v2)."""
        if not self.exists():
            return
        io = self.layout.io
        kill_file = None if self._v1 else self._dir("memory") / "cgroup.kill"
        by_kernel = kill_file is not None and kill_file.exists()
        if kill_file is not None and by_kernel:
            # Linux 5.14+: the kernel kills the whole subtree at once, frozen tasks and
            # processes forked meanwhile included (no pid listing to race a fork).
            io.write(kill_file, "1")
        else:
            # Signal first, then thaw: a frozen task keeps the SIGKILL pending and dies as
            # soon as it is thawed, so nothing in the cgroup gets to run (or fork) between.
            for pid in self.pids():
                io.kill(pid, signal.SIGKILL)
        gate = self.dirs.get("freezer") if self._v1 else self.dirs.get("memory")
        if gate is not None and gate.is_dir():
            self.thaw()
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():  # the kill is asynchronous: wait for the tasks to exit
            if not by_kernel:
                for pid in pids:
                    io.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise HostError(f"cgroup of {self.sandbox_id} still has pids {pids} "
                                f"after {timeout_s} s of SIGKILL")
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill everything and remove the cgroup directories (idempotent)."""
        self.close()
        self.kill_all()
        for directory in sorted(set(self.dirs.values()), reverse=True):
            for _ in range(200):  # rmdir can race the exit of the last task
                try:
                    self.layout.io.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                raise HostError(f"cannot remove cgroup {directory}: still busy after 2 s")
        logger.debug("removed cgroup of %s", self.sandbox_id)
