"""Residency is invisible, property-based: random sequences of file, IPC and process
operations, each printing a deterministic observation, run resident and torn down at every
boundary on the process and Docker backends (see test_differential.py for the oracle and
for how the suite was checked against the old /tmp hole).

A model of what each sequence leaves behind says which boundaries are resident-only by
design: a running `sleep` ("process"), a file in /dev/shm ("/dev/shm"), a SysV segment
("SysV shm") or a POSIX queue ("POSIX mqueue"). The pools are small (two /dev/shm names,
two SysV keys, one queue) so the check's reason names every leftover it found.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_differential import IMAGE, STATE_DIR, require_backend

from tenon.replay.differential import differential, open_manager
from tenon.replay.differential_script import Script, Step

pytestmark = pytest.mark.slow

BACKENDS = [pytest.param("process", marks=pytest.mark.sandbox, id="process"),
            pytest.param("docker", marks=pytest.mark.docker, id="docker")]
MAX_OPS = 8
MAX_EXAMPLES = 10

AREAS = {"workspace": "/workspace/p", "tmp": "/tmp/p", "home": "$HOME/p", "shm": "/dev/shm"}
FILE_NAMES = ("a", "b")
SYSV_KEYS = (0x7E4E0001, 0x7E4E0002)
MQ_NAMES = ("/tenon-q",)
SLEEPERS = ("s1", "s2")
SLEEPER_DIR = "/workspace/.sleepers"


def file_path(area: str, name: str) -> str:
    # /dev/shm files sit at its top so that each counts as one leftover.
    return f"/dev/shm/p-{name}" if area == "shm" else f"{AREAS[area]}/{name}"


def python(code: str) -> str:
    """A `python3 -c` command; `code` uses no single quotes."""
    assert "'" not in code
    return f"python3 -c '{code}'"


_LIBC = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
# shmget flags: IPC_CREAT 0o1000 | 0o600; IPC_RMID is 0. mq_open: O_CREAT 0o100 | O_RDWR 2.


@dataclass
class Model:
    """What the sandbox holds outside the persistent directories after each operation."""

    shm_files: set[str] = field(default_factory=set)
    sysv: set[int] = field(default_factory=set)
    queues: set[str] = field(default_factory=set)
    sleepers: set[str] = field(default_factory=set)

    def resident_because(self) -> str | None:
        if self.sleepers:  # the check names processes before any other leftover
            return "process"
        if self.shm_files:
            return "/dev/shm"
        if self.sysv:
            return "SysV shm"
        if self.queues:
            return "POSIX mqueue"
        return None


@dataclass(frozen=True)
class Op:
    kind: str
    target: str = ""
    text: str = ""

    def command(self) -> str:
        return COMMANDS[self.kind](self)

    def apply(self, model: Model) -> None:
        shm = self.target.startswith("/dev/shm/")
        if self.kind in ("write", "append") and shm:
            model.shm_files.add(self.target)
        elif self.kind == "remove" and shm:
            model.shm_files.discard(self.target)
        elif self.kind == "sysv_create":
            model.sysv.add(int(self.target))
        elif self.kind == "sysv_remove":
            model.sysv.discard(int(self.target))
        elif self.kind == "mq_create":
            model.queues.add(self.target)
        elif self.kind == "mq_remove":
            model.queues.discard(self.target)
        elif self.kind == "sleep_start":
            model.sleepers.add(self.target)
        elif self.kind == "sleep_stop":
            model.sleepers.discard(self.target)


def _write(op: Op, redirect: str) -> str:
    directory = op.target.rsplit("/", 1)[0]
    return (f"mkdir -p {directory} && printf '%s\\n' {op.text} {redirect} {op.target} && "
            f"echo {op.kind} {op.target}: $(wc -l < {op.target}) lines")


def _sysv(op: Op, action: str) -> str:
    key = int(op.target)
    if action == "remove":
        return f"ipcrm -M {key} 2>/dev/null && echo sysv {key} removed || echo sysv {key} absent"
    flags = "0o1600" if action == "create" else "0"
    size = 4096 if action == "create" else 0
    return python(f"{_LIBC}i = libc.shmget({key}, {size}, {flags}); "
                  f"print(\"sysv {key}\", \"{action}:\", \"present\" if i >= 0 else \"absent\")")


def _mq(op: Op, action: str) -> str:
    name = op.target
    if action == "remove":
        call = f"r = libc.mq_unlink(b\"{name}\")"
        verdict = "\"removed\" if r == 0 else \"absent\""
    else:
        flags = "0o102" if action == "create" else "0"
        call = (f"r = libc.mq_open(b\"{name}\", {flags}, 0o600, None); "
                "r >= 0 and libc.mq_close(r)")
        verdict = "\"present\" if r >= 0 else \"absent\""
    return python(f"{_LIBC}{call}; print(\"mq {name} {action}:\", {verdict})")


def _sleep_start(op: Op) -> str:
    pidfile = f"{SLEEPER_DIR}/{op.target}"
    return (f"mkdir -p {SLEEPER_DIR}; if [ -f {pidfile} ]; then echo sleeper {op.target} "
            f"already running; else nohup sleep 600 >/dev/null 2>&1 & echo $! > {pidfile}; "
            f"echo sleeper {op.target} started; fi")


def _sleep_stop(op: Op) -> str:
    pidfile = f"{SLEEPER_DIR}/{op.target}"
    return (f"if [ -f {pidfile} ]; then pid=$(cat {pidfile}); kill $pid; i=0; "
            "while kill -0 $pid 2>/dev/null && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); "
            f"done; rm {pidfile}; echo sleeper {op.target} stopped; "
            f"else echo sleeper {op.target} not running; fi")


def _sleep_check(op: Op) -> str:
    pidfile = f"{SLEEPER_DIR}/{op.target}"
    return (f"if [ -f {pidfile} ] && kill -0 $(cat {pidfile}) 2>/dev/null; "
            f"then echo sleeper {op.target} running; else echo sleeper {op.target} idle; fi")


COMMANDS = {
    "write": lambda op: _write(op, ">"),
    "append": lambda op: _write(op, ">>"),
    "remove": lambda op: f"rm -f {op.target}; echo removed {op.target}",
    "read": lambda op: f"cat {op.target} 2>/dev/null || echo no {op.target}",
    "list": lambda op: f"echo {op.target}:; ls -A {op.target} 2>/dev/null | grep -v '^[.]' "
                       "|| echo '(empty)'",
    "sysv_create": lambda op: _sysv(op, "create"),
    "sysv_check": lambda op: _sysv(op, "check"),
    "sysv_remove": lambda op: _sysv(op, "remove"),
    "mq_create": lambda op: _mq(op, "create"),
    "mq_check": lambda op: _mq(op, "check"),
    "mq_remove": lambda op: _mq(op, "remove"),
    "sleep_start": _sleep_start,
    "sleep_stop": _sleep_stop,
    "sleep_check": _sleep_check,
}

paths = st.builds(file_path, st.sampled_from(sorted(AREAS)), st.sampled_from(FILE_NAMES))
words = st.sampled_from(("alpha", "beta", "gamma", "delta"))
operations = st.one_of(
    st.builds(Op, st.sampled_from(("write", "append")), paths, words),
    st.builds(Op, st.sampled_from(("remove", "read")), paths),
    st.builds(Op, st.just("list"), st.sampled_from(sorted(AREAS.values()))),
    st.builds(Op, st.sampled_from(("sysv_create", "sysv_check", "sysv_remove")),
              st.sampled_from([str(k) for k in SYSV_KEYS])),
    st.builds(Op, st.sampled_from(("mq_create", "mq_check", "mq_remove")),
              st.sampled_from(MQ_NAMES)),
    st.builds(Op, st.sampled_from(("sleep_start", "sleep_stop", "sleep_check")),
              st.sampled_from(SLEEPERS)),
)


# Every action ends by observing every file the operations may have made, so state lost
# at a teardown shows at the very next action, not only when a later read happens to ask.
OBSERVE = ("; echo state: $( (ls /workspace/p /tmp/p $HOME/p /dev/shm; "
           "cat /workspace/p/* /tmp/p/* $HOME/p/* /dev/shm/p-*) 2>/dev/null | cksum)")


def script_of(ops: list[Op]) -> Script:
    model = Model()
    steps = []
    for op in ops:
        op.apply(model)
        steps.append(Step(op.command() + OBSERVE, timeout_s=30,
                          resident_because=model.resident_because()))
    return Script("random", tuple(steps))


def test_the_model_follows_leftovers_and_processes_first():
    ops = [Op("write", "/dev/shm/p-a", "x"), Op("sleep_start", "s1"), Op("sleep_stop", "s1"),
           Op("remove", "/dev/shm/p-a"), Op("sysv_create", str(SYSV_KEYS[0])),
           Op("write", "/tmp/p/a", "y")]
    reasons = [step.resident_because for step in script_of(ops).steps]
    assert reasons == ["/dev/shm", "process", "/dev/shm", None, "SysV shm", "SysV shm"]


async def check(backend: str, ops: list[Op]) -> None:
    script = script_of(ops)
    async with open_manager(backend, state_dir=STATE_DIR) as manager:
        _, _, comparison = await differential(manager, script, image=IMAGE)
    assert comparison.ok, comparison.first_failure()
    assert comparison.divergences == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_operations_are_identical_resident_and_torn_down(backend: str) -> None:
    require_backend(backend)

    num_ops: list[int] = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(operations, min_size=1, max_size=MAX_OPS))
    @example([Op("write", file_path("tmp", "a"), "alpha"), Op("read", file_path("tmp", "a"))])
    @example([Op("append", file_path("home", "b"), "beta"), Op("list", AREAS["home"])])
    def run(ops: list[Op]) -> None:
        asyncio.run(check(backend, ops))
        num_ops.append(len(ops))

    run()
    assert len(num_ops) >= MAX_EXAMPLES  # every generated sequence really ran
