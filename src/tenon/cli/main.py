"""The `tenon` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tenon.errors import TenonError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
image_app = typer.Typer(no_args_is_help=True, help="Build and inspect the base image.")
app.add_typer(image_app, name="image")

console = Console()
DEFAULT_STATE_DIR = Path("/var/lib/tenon")
DEFAULT_IMAGE = "tenon-base:bookworm"

StateDir = Annotated[Path, typer.Option(help="Tenon's state directory.")]
Image = Annotated[str, typer.Option(help="Base image name.")]


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Tenon: serve many LLM agents' sandboxes under one memory budget."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING)


@app.command()
def doctor(state_dir: StateDir = DEFAULT_STATE_DIR, image: Image = DEFAULT_IMAGE) -> None:
    """Print what this host supports and what is missing, with the command that fixes it."""
    from tenon.cli.doctor import run_checks

    table = Table("check", "status", "detail", "fix")
    checks = run_checks(state_dir, image)
    for check in checks:
        status = "[green]ok[/green]" if check.ok else "[red]missing[/red]"
        table.add_row(check.name, status, check.detail, check.fix)
    console.print(table)
    if not all(c.ok for c in checks):
        console.print("[yellow]some features are unavailable; see the fix column[/yellow]")


@image_app.command("build")
def image_build(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the base image locally (mmdebstrap; nothing is pulled)."""
    from tenon.sandbox.image import build_image

    try:
        info = build_image(image, state_dir=state_dir, force=force)
    except TenonError as exc:
        _fail(exc)
    console.print(f"base image {image}: {info}")
