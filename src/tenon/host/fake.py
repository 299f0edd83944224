"""A scripted cgroup v2 tree in a plain directory, for tests, the simulator and demos.

The files are real files laid out as the kernel shows them; `FakeCgroupV2Tree.io` plays the
kernel's part for the operations that have side effects, so the driver in `host/` runs
unchanged against it:

- mkdir populates a cgroup's interface files; its controllers are the parent's subtree_control;
- writes are validated (unknown file, bad value, controller not enabled -> HostError, as the
  kernel would refuse them); cgroup.freeze is reflected in cgroup.events ("frozen 1") at once,
  unless the test stalled that cgroup's freezer; a pid written to cgroup.procs moves there;
- memory.current, memory.peak and cpu.stat usage roll up to ancestors, memory.events is
  hierarchical (memory.events.local is not), as on the kernel;
- rmdir refuses a cgroup with processes or children; kill removes fake processes only.

Fake pids are numbered above any real pid_max, and a signal to a pid the script did not
spawn raises UnscriptedError rather than reaching a real process. Memory limits are not
enforced: an OOM kill happens when the script says so (add_oom_kill).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import signal
from pathlib import Path

from tenon.errors import HostError
from tenon.host.layout import CgroupLayout, detect_layout

logger = logging.getLogger(__name__)

FAKE_PID_BASE = 10_000_000  # above the kernel's maximum pid_max (2**22)
_EVENT_KEYS = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")


class UnscriptedError(HostError, LookupError):
    """The fake was asked for something its script does not cover."""


def _pressure_text(some10: float = 0.0, some60: float = 0.0, full10: float = 0.0,
                   full60: float = 0.0, some_us: int = 0, full_us: int = 0) -> str:
    return (f"some avg10={some10:.2f} avg60={some60:.2f} avg300=0.00 total={some_us}\n"
            f"full avg10={full10:.2f} avg60={full60:.2f} avg300=0.00 total={full_us}\n")


class FakeCgroupV2Tree:
    """Builder and kernel stand-in for a cgroup2 hierarchy rooted at `root`."""

    def __init__(self, root: Path, controllers: tuple[str, ...] = ("cpu", "io", "memory", "pids"),
                 *, swap: bool = True, peak: bool = True) -> None:
        self.root = root
        self.swap = swap  # memory.swap.* present (a kernel with swap accounting)
        self.peak = peak  # memory.peak present (Linux >= 5.19)
        self.io = _FakeIO(self)
        self.signals: list[tuple[int, int]] = []  # (pid, signal) as the driver sent them
        self._where: dict[int, str] = {}  # fake pid -> cgroup
        self._own: dict[str, dict[str, int]] = {}  # cgroup -> its own (not rolled-up) usage
        self._stalled: set[str] = set()
        self._next_pid = FAKE_PID_BASE
        root.mkdir(parents=True, exist_ok=True)
        self._write_files("", {"cgroup.controllers": " ".join(controllers) + "\n",
                               "cgroup.subtree_control": "\n", "cgroup.procs": ""})

    # -- addressing ------------------------------------------------------------------------

    def path(self, cgroup: str) -> Path:
        return self.root / cgroup if cgroup else self.root

    def name_of(self, path: Path) -> str:
        rel = path.relative_to(self.root).as_posix()
        return "" if rel == "." else rel

    def _require(self, cgroup: str) -> Path:
        p = self.path(cgroup)
        if cgroup and cgroup not in self._own:
            raise UnscriptedError(f"fake cgroup {cgroup!r} was never created (make_cgroup or "
                                  f"the driver's mkdir); known: {sorted(self._own)}")
        return p

    def layout(self) -> CgroupLayout:
        """The layout the driver should use: detected from the files, with this fake's io."""
        return dataclasses.replace(detect_layout(self.root), io=self.io)

    def _write_files(self, cgroup: str, files: dict[str, str]) -> None:
        for name, text in files.items():
            (self.path(cgroup) / name).write_text(text)

    def read(self, cgroup: str, name: str) -> str:
        return (self._require(cgroup) / name).read_text()

    # -- building --------------------------------------------------------------------------

    def make_cgroup(self, cgroup: str) -> Path:
        """What the kernel does on mkdir: the interface files for the enabled controllers."""
        if not cgroup:
            raise UnscriptedError("the root cgroup exists already")
        parent = cgroup.rpartition("/")[0]
        self._require(parent)
        p = self.path(cgroup)
        if cgroup in self._own:
            return p
        p.mkdir()
        enabled = self.read(parent, "cgroup.subtree_control").split()
        files = {"cgroup.controllers": " ".join(enabled) + "\n", "cgroup.subtree_control": "\n",
                 "cgroup.procs": "", "cgroup.events": "populated 0\nfrozen 0\n",
                 "cgroup.freeze": "0\n", "cgroup.kill": "",
                 "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
                 "cpu.pressure": _pressure_text(), "memory.pressure": _pressure_text(),
                 "io.pressure": _pressure_text()}
        if "memory" in enabled:
            events = "".join(f"{k} 0\n" for k in _EVENT_KEYS)
            files |= {"memory.current": "0\n", "memory.max": "max\n", "memory.high": "max\n",
                      "memory.low": "0\n", "memory.min": "0\n", "memory.events": events,
                      "memory.events.local": events, "memory.stat": "anon 0\nfile 0\n",
                      "memory.oom.group": "0\n"}
            if self.peak:
                files["memory.peak"] = "0\n"
            if self.swap:
                files |= {"memory.swap.current": "0\n", "memory.swap.max": "max\n"}
        if "pids" in enabled:
            files |= {"pids.max": "max\n", "pids.current": "0\n"}
        if "cpu" in enabled:
            files |= {"cpu.max": "max 100000\n", "cpu.weight": "100\n"}
        self._write_files(cgroup, files)
        self._own[cgroup] = {"current": 0, "swap": 0, "usage_usec": 0, "peak": 0}
        return p

    def set_memory(self, cgroup: str, current: int, peak: int | None = None,
                   swap: int = 0) -> None:
        """Set the cgroup's own usage (children roll up into it); peak only ever rises."""
        self._require(cgroup)
        own = self._own[cgroup]
        own["current"], own["swap"] = current, swap
        own["peak"] = max(own["peak"], current, peak or 0)
        self._rollup(cgroup)

    def set_cpu_usage(self, cgroup: str, usage_s: float) -> None:
        self._require(cgroup)
        self._own[cgroup]["usage_usec"] = round(usage_s * 1e6)
        self._rollup(cgroup)

    def set_pressure(self, cgroup: str, *, some_avg10: float = 0.0, some_avg60: float = 0.0,
                     full_avg10: float = 0.0, full_avg60: float = 0.0, some_total_us: int = 0,
                     full_total_us: int = 0) -> None:
        text = _pressure_text(some_avg10, some_avg60, full_avg10, full_avg60,
                              some_total_us, full_total_us)
        (self._require(cgroup) / "memory.pressure").write_text(text)

    def spawn(self, cgroup: str) -> int:
        """A new fake process in `cgroup`; returns its pid."""
        self._require(cgroup)
        pid, self._next_pid = self._next_pid, self._next_pid + 1
        self._move(pid, cgroup)
        return pid

    def exit(self, pid: int) -> None:
        """The process `pid` exits (it leaves its cgroup)."""
        cgroup = self._where.pop(self._known(pid))
        self._sync_procs(cgroup)

    def add_oom_kill(self, cgroup: str, num_kills: int = 1, victim: int | None = None) -> None:
        """The kernel OOM-killed `num_kills` tasks in `cgroup` (and `victim` exits)."""
        self._require(cgroup)
        for key in ("oom", "oom_kill"):
            self._bump(cgroup, "memory.events.local", key, num_kills)
        anc: str | None = cgroup
        while anc:  # memory.events is hierarchical; the root has none
            for key in ("oom", "oom_kill"):
                self._bump(anc, "memory.events", key, num_kills)
            anc = anc.rpartition("/")[0]
        if victim is not None:
            self.exit(victim)

    def stall_freezer(self, cgroup: str, stalled: bool = True) -> None:
        """Make cgroup.freeze writes in `cgroup` never settle (to exercise the timeout)."""
        self._require(cgroup)
        (self._stalled.add if stalled else self._stalled.discard)(cgroup)

    def events(self, cgroup: str) -> dict[str, int]:
        text = self.read(cgroup, "cgroup.events")
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())}

    # -- kernel behaviour --------------------------------------------------------------------

    def _known(self, pid: int) -> int:
        if pid not in self._where:
            raise UnscriptedError(f"pid {pid} was never spawned in the fake tree (spawn())")
        return pid

    def _move(self, pid: int, cgroup: str) -> None:
        old = self._where.get(pid)
        self._where[pid] = cgroup
        for c in {cgroup} if old is None else {old, cgroup}:
            self._sync_procs(c)

    def _sync_procs(self, cgroup: str) -> None:
        pids = sorted(p for p, c in self._where.items() if c == cgroup)
        (self.path(cgroup) / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        if cgroup:
            subtree = [c for c in self._where.values() if c == cgroup or
                       c.startswith(cgroup + "/")]
            self._set_event(cgroup, "populated", int(bool(subtree)))
            if "pids" in self.read(cgroup, "cgroup.controllers").split():
                (self.path(cgroup) / "pids.current").write_text(f"{len(pids)}\n")

    def _set_event(self, cgroup: str, key: str, value: int) -> None:
        events = self.events(cgroup) | {key: value}
        (self.path(cgroup) / "cgroup.events").write_text(
            "".join(f"{k} {v}\n" for k, v in events.items()))

    def _bump(self, cgroup: str, name: str, key: str, by: int) -> None:
        p = self.path(cgroup) / name
        if not p.exists():
            return
        values = {k: int(v) for k, v in (line.split() for line in p.read_text().splitlines())}
        values[key] = values.get(key, 0) + by
        p.write_text("".join(f"{k} {v}\n" for k, v in values.items()))

    def _rollup(self, cgroup: str) -> None:
        anc: str | None = cgroup
        while anc:
            kids = [c for c in self._own if c.rpartition("/")[0] == anc]
            own = self._own[anc]
            total = {k: own[k] + sum(self._total(c, k) for c in kids)
                     for k in ("current", "swap", "usage_usec")}
            own["peak"] = max(own["peak"], total["current"])
            own["_total_current"], own["_total_swap"] = total["current"], total["swap"]
            own["_total_usage_usec"] = total["usage_usec"]
            p = self.path(anc)
            if (p / "memory.current").exists():
                (p / "memory.current").write_text(f"{total['current']}\n")
            if (p / "memory.peak").exists():
                (p / "memory.peak").write_text(f"{own['peak']}\n")
            if (p / "memory.swap.current").exists():
                (p / "memory.swap.current").write_text(f"{total['swap']}\n")
            (p / "cpu.stat").write_text(f"usage_usec {total['usage_usec']}\n"
                                        f"user_usec {total['usage_usec']}\nsystem_usec 0\n")
            anc = anc.rpartition("/")[0]

    def _total(self, cgroup: str, key: str) -> int:
        own = self._own[cgroup]
        return own.get(f"_total_{key}", own[key])

    def write(self, path: Path, text: str) -> None:
        cgroup, name = self.name_of(path.parent), path.name
        self._require(cgroup)
        if not path.is_file():
            raise HostError(f"cannot write {text!r} to {path}: no such control file "
                            f"(controller not enabled for this cgroup?)")
        value = text.strip()
        handler = _WRITERS.get(name)
        if handler is None:
            raise UnscriptedError(f"the fake v2 tree does not script writes to {name}")
        handler(self, cgroup, path, value)

    def _write_subtree(self, cgroup: str, path: Path, value: str) -> None:
        available = self.read(cgroup, "cgroup.controllers").split()
        enabled = self.read(cgroup, "cgroup.subtree_control").split()
        for token in value.split():
            sign, controller = token[0], token[1:]
            if sign not in "+-" or controller not in available:
                raise HostError(f"cannot write {value!r} to {path}: controller {controller!r} "
                                f"not in cgroup.controllers ({' '.join(available)})")
            enabled = sorted(set(enabled) | {controller} if sign == "+"
                             else set(enabled) - {controller})
        path.write_text(" ".join(enabled) + "\n")

    def _write_limit(self, cgroup: str, path: Path, value: str) -> None:
        if value != "max" and not (value.isdigit()):
            raise HostError(f"cannot write {value!r} to {path}: invalid argument")
        path.write_text(value + "\n")

    def _write_cpu_max(self, cgroup: str, path: Path, value: str) -> None:
        parts = value.split()
        if not (1 <= len(parts) <= 2 and (parts[0] == "max" or parts[0].isdigit())
                and all(p.isdigit() for p in parts[1:])):
            raise HostError(f"cannot write {value!r} to {path}: invalid argument")
        period = parts[1] if len(parts) == 2 else path.read_text().split()[1]
        path.write_text(f"{parts[0]} {period}\n")

    def _write_freeze(self, cgroup: str, path: Path, value: str) -> None:
        if value not in ("0", "1"):
            raise HostError(f"cannot write {value!r} to {path}: invalid argument")
        path.write_text(value + "\n")
        if cgroup not in self._stalled:
            self._set_event(cgroup, "frozen", int(value))

    def _write_procs(self, cgroup: str, path: Path, value: str) -> None:
        self._move(self._known(int(value)), cgroup)

    def _write_flag(self, cgroup: str, path: Path, value: str) -> None:
        if value not in ("0", "1"):
            raise HostError(f"cannot write {value!r} to {path}: invalid argument")
        path.write_text(value + "\n")

    def open_reset(self, path: Path) -> int:
        """memory.peak reset for the returned descriptor. The fake keeps one mark, so the
        reset shows in every reader (the kernel keeps one per open file)."""
        cgroup = self.name_of(path.parent)
        self._require(cgroup)
        if path.name != "memory.peak" or not path.is_file():
            raise OSError(errno.EACCES, f"{os.strerror(errno.EACCES)}: no per-open reset of "
                                        f"{path.name} here", str(path))
        self._own[cgroup]["peak"] = 0  # the rollup raises it to the usage
        self._rollup(cgroup)
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _write_kill(self, cgroup: str, path: Path, value: str) -> None:
        if value != "1":
            raise HostError(f"cannot write {value!r} to {path}: invalid argument")
        for pid, c in list(self._where.items()):
            if c == cgroup or c.startswith(cgroup + "/"):
                self.signals.append((pid, signal.SIGKILL))  # the kernel SIGKILLs each one
                self.exit(pid)

    def rmdir(self, path: Path) -> None:
        cgroup = self.name_of(path)
        if cgroup not in self._own:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        busy = [p for p, c in self._where.items() if c == cgroup]
        kids = [c for c in self._own if c.startswith(cgroup + "/")]
        if busy or kids:
            raise OSError(errno.EBUSY, f"{os.strerror(errno.EBUSY)} (pids {busy}, "
                                       f"children {kids})", str(path))
        shutil.rmtree(path)
        del self._own[cgroup]
        self._stalled.discard(cgroup)
        if parent := cgroup.rpartition("/")[0]:
            self._rollup(parent)

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self._where:
            if FAKE_PID_BASE <= pid < self._next_pid:  # spawned once and gone: ESRCH, ignored
                return
            raise UnscriptedError(f"refusing to signal pid {pid}: not a fake process")
        self.signals.append((pid, sig))
        if sig == signal.SIGKILL:  # v2 delivers fatal signals to frozen tasks as well
            self.exit(pid)


_WRITERS = {
    "cgroup.subtree_control": FakeCgroupV2Tree._write_subtree,
    "memory.max": FakeCgroupV2Tree._write_limit, "memory.high": FakeCgroupV2Tree._write_limit,
    "memory.swap.max": FakeCgroupV2Tree._write_limit, "memory.low": FakeCgroupV2Tree._write_limit,
    "memory.min": FakeCgroupV2Tree._write_limit, "pids.max": FakeCgroupV2Tree._write_limit,
    "cpu.max": FakeCgroupV2Tree._write_cpu_max, "cgroup.freeze": FakeCgroupV2Tree._write_freeze,
    "cgroup.procs": FakeCgroupV2Tree._write_procs, "cgroup.kill": FakeCgroupV2Tree._write_kill,
    "memory.oom.group": FakeCgroupV2Tree._write_flag,
}


class _FakeIO:
    """The CgroupIO the driver uses on a fake tree."""

    def __init__(self, tree: FakeCgroupV2Tree) -> None:
        self._tree = tree

    def write(self, path: Path, text: str) -> None:
        self._tree.write(path, text)

    def mkdir(self, path: Path) -> None:
        self._tree.make_cgroup(self._tree.name_of(path))

    def rmdir(self, path: Path) -> None:
        self._tree.rmdir(path)

    def kill(self, pid: int, sig: int) -> None:
        self._tree.kill(pid, sig)

    def open_reset(self, path: Path) -> int:
        return self._tree.open_reset(path)
