"""`tenon doctor`: what this host supports, what is missing, and the fix."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _cgroup_checks() -> list[Check]:
    from tenon.host.layout import detect_layout
    from tenon.host.types import CgroupVersion

    try:
        layout = detect_layout()
    except Exception as exc:  # doctor reports, it never crashes
        return [Check("cgroups", False, str(exc), "mount cgroup v2 or the v1 memory controller")]
    checks = [Check("cgroup layout", True, layout.version.value)]
    wanted = ("memory", "freezer", "pids", "cpu") if layout.version is CgroupVersion.V1 else (
        "memory", "pids", "cpu")
    have = set(layout.controllers)
    for controller in wanted:
        ok = controller in have
        checks.append(Check(f"controller {controller}", ok, "present" if ok else "missing",
                            "" if ok else f"enable the {controller} cgroup controller"))
    if layout.version is CgroupVersion.V2:
        checks.append(Check("freezer", True, "cgroup.freeze (v2)"))
    for problem in layout.missing:
        checks.append(Check("cgroups", False, problem))
    return checks


def _psi_check() -> Check:
    from tenon.host.psi import read_pressure

    reading = read_pressure()
    if reading is None:
        return Check("PSI", False, "/proc/pressure/memory absent", "boot with psi=1")
    return Check("PSI", True, f"memory some avg10={reading.some_avg10:.2f}%")


def _gate_actuator_check() -> Check:
    """Which gate actuator `auto` gives this host, and why (the freezer is always fine)."""
    from tenon.host.scx.loader import availability

    try:
        available, reason = availability()
    except Exception as exc:  # doctor reports, it never crashes
        return Check("gate actuator", True, f"freezer (sched_ext check failed: {exc})")
    return Check("gate actuator", True, f"{'sched_ext' if available else 'freezer'}: {reason}")


def _isolation_checks() -> list[Check]:
    from tenon.sandbox import launcher
    from tenon.sandbox.uids import IdRangeAllocator, UidAllocator

    helper = launcher.check()
    clashes = [*UidAllocator().check(), *IdRangeAllocator().check()]
    slirp = shutil.which("slirp4netns")
    nft = shutil.which("nft", path="/usr/sbin:/usr/bin:/sbin:/bin")
    return [
        Check("sandbox launcher", not helper, helper[0] if helper else str(launcher.LAUNCHER),
              "python -m tenon.sandbox.launcher build" if helper else ""),
        Check("sandbox uid range", not clashes, "; ".join(clashes) or "no clash",
              "free the range or pass another to UidAllocator" if clashes else ""),
        Check("slirp4netns", slirp is not None,
              f"{slirp}" if slirp else "missing (network=True needs it)",
              "" if slirp else "apt-get install slirp4netns"),
        Check("nft", nft is not None, nft or "missing (network rules need it)",
              "" if nft else "apt-get install nftables"),
    ]


def _docker_checks(image: str) -> list[Check]:
    from tenon.sandbox.docker import engine_problems
    from tenon.sandbox.dockerd import connect

    try:
        client = connect(timeout_s=5)
        version = client.version().get("Version", "?")
    except Exception as exc:
        return [Check("Docker Engine", False, f"not answering ({type(exc).__name__})",
                      "bash scripts/setup.sh  (installs docker.io and starts dockerd)")]
    checks = [Check("Docker Engine", True, f"version {version}")]
    try:
        problems = engine_problems(client)
    except Exception as exc:  # doctor reports, it never crashes
        problems = [f"cannot query its security options ({type(exc).__name__})"]
    checks.append(Check("Docker isolation", not problems, "; ".join(problems) or
                        "seccomp on, tenon-sandboxes isolated (or not made yet)",
                        "see the problem's fix" if problems else ""))
    try:
        client.images.get(image)
        checks.append(Check(f"docker image {image}", True, "present"))
    except Exception:
        checks.append(Check(f"docker image {image}", False, "missing", "tenon image build"))
    finally:
        client.close()
    return checks


def run_checks(state_dir: Path, image: str, image_dir: Path | None = None) -> list[Check]:
    """Every check, in the order printed; the image is looked up in `image_dir` when given,
    else where a backend over `state_dir` finds it (`images.image_store`)."""
    from tenon.sandbox.images import ImageStore, image_store

    checks = _cgroup_checks()
    checks.append(_psi_check())
    checks.append(_gate_actuator_check())
    checks.extend(_isolation_checks())
    try:
        store = ImageStore(image_dir) if image_dir is not None else image_store(state_dir)
        rootfs = store.get(image).rootfs
        checks.append(Check(f"base rootfs {image}", True, str(rootfs)))
    except Exception as exc:
        checks.append(Check(f"base rootfs {image}", False, str(exc).splitlines()[0],
                            "tenon image build"))
    checks.extend(_docker_checks(image))
    return checks
