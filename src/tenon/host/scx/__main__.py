"""`python -m tenon.host.scx build [--release R --vmlinux-h FILE]`: print the object's path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tenon.errors import HostError
from tenon.host.scx.build import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tenon.host.scx")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("build", help="build the tenon_gate BPF object and print its path")
    cmd.add_argument("--release", help="kernel release to build for (default: this kernel)")
    cmd.add_argument("--vmlinux-h", type=Path,
                     help="that kernel's dumped vmlinux.h (needs --release)")
    args = parser.parse_args(argv)
    if args.vmlinux_h is not None and args.release is None:
        parser.error("--vmlinux-h needs --release")
    try:
        print(build(release=args.release, vmlinux_h=args.vmlinux_h))
    except HostError as exc:
        print(f"tenon scx build: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
