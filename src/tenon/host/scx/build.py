"""Build gate.bpf.c into a BPF object for the running kernel (or a named one), with a cache.

The object is compiled against the kernel's own BTF (`vmlinux.h`, dumped with bpftool) and the
libbpf headers, then cached per kernel release and source digest: dumping the BTF is the slow
part (minutes under emulation) and happens once per kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tenon.errors import HostError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gate.bpf.c")
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
DEFAULT_CACHE_ROOT = Path("/var/cache/tenon/scx")
CLANG_CANDIDATES = ("clang", "clang-16", "clang-17", "clang-18", "clang-19", "clang-20")
# Recent kernels embed tagged anonymous structs (-fms-extensions), which BTF reproduces.
CLANG_FLAGS = ("-target", "bpf", "-O2", "-g", "-fms-extensions", "-Wno-microsoft-anon-tag",
               "-D__TARGET_ARCH_x86")
BTF_DUMP_TIMEOUT_S = 900.0
COMPILE_TIMEOUT_S = 300.0


class BuildToolMissing(HostError, FileNotFoundError):
    """bpftool, a BPF-capable clang, the libbpf headers or the kernel's BTF is missing."""


@dataclass(frozen=True, slots=True)
class Toolchain:
    """Where the build's tools are (from TENON_BPFTOOL, TENON_BPF_CLANG, TENON_BPF_INCLUDE)."""

    bpftool: str
    clang: str
    include_dir: Path

    @classmethod
    def from_env(cls) -> Toolchain:
        """Resolve the tools, raising BuildToolMissing for the first one absent."""
        bpftool = _which(os.environ.get("TENON_BPFTOOL") or "bpftool")
        if bpftool is None:
            raise BuildToolMissing("bpftool not found (set TENON_BPFTOOL)")
        wanted = os.environ.get("TENON_BPF_CLANG")
        candidates = (wanted,) if wanted else CLANG_CANDIDATES
        clang = next((found for c in candidates if (found := _which(c)) is not None), None)
        if clang is None:
            raise BuildToolMissing(f"no clang found among {', '.join(candidates)} "
                                   f"(set TENON_BPF_CLANG)")
        include_dir = Path(os.environ.get("TENON_BPF_INCLUDE") or "/usr/include")
        if not (include_dir / "bpf" / "bpf_helpers.h").is_file():
            raise BuildToolMissing(f"libbpf headers not found: no {include_dir}/bpf/bpf_helpers.h "
                                   f"(set TENON_BPF_INCLUDE)")
        return cls(bpftool, clang, include_dir)


def _which(name: str) -> str | None:
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name)


def cache_dir(release: str | None = None) -> Path:
    """Where objects for `release` (default: the running kernel) are kept (TENON_SCX_CACHE
    replaces the root)."""
    root = Path(os.environ.get("TENON_SCX_CACHE") or DEFAULT_CACHE_ROOT)
    return root / (release or platform.release())


def source_digest() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(CLANG_FLAGS).encode())
    return digest.hexdigest()[:16]


def build(*, release: str | None = None, vmlinux_h: Path | None = None,
          tools: Toolchain | None = None) -> Path:
    """The path of gate.bpf.o for `release`, compiling it (and dumping vmlinux.h) if needed.

    `vmlinux_h` builds for another kernel from its dumped header (its release must be named);
    otherwise the header comes from this kernel's /sys/kernel/btf/vmlinux.
    """
    if vmlinux_h is not None and release is None:
        raise ValueError("a vmlinux.h from elsewhere needs the kernel release it belongs to")
    directory = cache_dir(release)
    obj = directory / f"gate-{source_digest()}.bpf.o"
    if obj.is_file():
        return obj
    tools = tools or Toolchain.from_env()
    directory.mkdir(parents=True, exist_ok=True)
    header = directory / "vmlinux.h"
    if vmlinux_h is not None:
        shutil.copyfile(vmlinux_h, _partial(header))
        os.replace(_partial(header), header)
    elif not header.is_file():
        _dump_btf(tools, header)
    _compile(tools, directory, obj)
    return obj


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}")


def _dump_btf(tools: Toolchain, header: Path) -> None:
    if not VMLINUX_BTF.is_file():
        raise BuildToolMissing(f"{VMLINUX_BTF} is missing: the kernel has no BTF "
                               f"(CONFIG_DEBUG_INFO_BTF)")
    logger.info("dumping %s into %s (slow under emulation)", VMLINUX_BTF, header)
    partial = _partial(header)
    with partial.open("wb") as out:
        _run([tools.bpftool, "btf", "dump", "file", str(VMLINUX_BTF), "format", "c"],
             stdout=out, timeout_s=BTF_DUMP_TIMEOUT_S)
    os.replace(partial, header)


def _compile(tools: Toolchain, directory: Path, obj: Path) -> None:
    partial = _partial(obj)
    _run([tools.clang, *CLANG_FLAGS, f"-I{directory}", f"-I{tools.include_dir}",
          "-c", str(SOURCE), "-o", str(partial)], timeout_s=COMPILE_TIMEOUT_S)
    os.replace(partial, obj)
    logger.info("built %s", obj)


def _run(argv: list[str], *, timeout_s: float, stdout: IO[bytes] | None = None) -> None:
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE if stdout is None else stdout,
                              stderr=subprocess.PIPE, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise BuildToolMissing(f"{argv[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise HostError(f"{argv[0]} {argv[1]} did not finish in {timeout_s} s") from exc
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise HostError(f"{' '.join(argv[:3])} failed ({done.returncode}): "
                        f"{err[-1] if err else 'no output'}")
