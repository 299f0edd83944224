"""`tenon image`: build, import, list and remove the images sandboxes run on."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from tenon.cli.console import make_console
from tenon.cli.errors import fail, require_writable_dir
from tenon.errors import TenonError
from tenon.units import format_bytes

if TYPE_CHECKING:
    from tenon.sandbox.images import ImageStore, StoredImage

image_app = typer.Typer(no_args_is_help=True,
                        help="Build, import, list and remove the images sandboxes run on.")
console = make_console()

ImageDir = Annotated[Path | None, typer.Option(
    help="The image store (default: $TENON_IMAGE_DIR, else /var/lib/tenon/images).")]
Name = Annotated[str | None, typer.Option(help="The name sandboxes ask for (name:tag).")]


def _store(image_dir: Path | None, state_dir: Path | None = None) -> ImageStore:
    from tenon.sandbox.images import ImageStore, default_image_dir

    if state_dir is not None:
        require_writable_dir(state_dir, what="--state-dir")
        return ImageStore(state_dir / "images")
    root = image_dir if image_dir is not None else default_image_dir()
    require_writable_dir(root, what="--image-dir")
    return ImageStore(root)


def _print(stored: StoredImage) -> None:
    console.print(f"{stored.name}: {stored.meta.id[:12]} {format_bytes(stored.meta.size_bytes)}"
                  f" ({stored.meta.source}) at {stored.rootfs}", soft_wrap=True)


@image_app.command("build")
def image_build(
    context: Annotated[Path | None, typer.Argument(
        help="Build context of -f (default: the Dockerfile's directory).")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="Dockerfile to build on the local Docker daemon (nothing is "
        "pulled). Without it: the built-in images.")] = None,
    name: Name = None,
    image: Annotated[list[str] | None, typer.Option(
        help="Built-in image to build (repeatable; default: every built-in).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild a built-in even if current.")] = False,
    image_dir: ImageDir = None,
    state_dir: Annotated[Path | None, typer.Option(
        help="A state directory whose images/ is the store (instead of --image-dir).")] = None,
) -> None:
    """Build an image from a Dockerfile (-f, --name), or the built-in Debian images."""
    from tenon.sandbox.images import BUILTINS, build_builtin
    from tenon.sandbox.images.build import build_dockerfile

    try:
        store = _store(image_dir, state_dir)
        if file is not None:
            if not name:
                raise typer.BadParameter("-f needs --name (e.g. --name myapp:1)")
            _print(build_dockerfile(file, context, name=name, store=store))
            return
        if context is not None or name is not None:
            raise typer.BadParameter("a build context or --name goes with -f DOCKERFILE")
        for builtin in image or list(BUILTINS):
            _print(build_builtin(builtin, store=store, force=force))
    except (TenonError, OSError) as exc:
        fail(exc)


@image_app.command("import")
def image_import(
    source: Annotated[str, typer.Argument(
        help="A docker save tarball, an OCI layout directory (or tar), or the name of an "
             "image of the local Docker daemon.")],
    name: Name = None,
    image_dir: ImageDir = None,
) -> None:
    """Import an image (its layers applied in order, whiteouts included) into the store."""
    from tenon.sandbox.images.importer import import_image

    try:
        _print(import_image(source, name=name, store=_store(image_dir)))
    except (TenonError, OSError) as exc:
        fail(exc)


@image_app.command("list")
def image_list(image_dir: ImageDir = None) -> None:
    """The images of the store: name, content id, size, created, source."""
    store = _store(image_dir)
    table = Table()
    for column in ("name", "id", "size", "created"):  # whole; the source folds
        table.add_column(column, no_wrap=True)
    table.add_column("source", overflow="fold")
    for stored in store.images():
        created = datetime.datetime.fromtimestamp(stored.meta.created_s).strftime(
            "%Y-%m-%d %H:%M")
        table.add_row(stored.name, stored.meta.id[:12], format_bytes(stored.meta.size_bytes),
                      created, stored.meta.source)
    console.print(table)


@image_app.command("rm")
def image_rm(name: Annotated[str, typer.Argument(help="The image name to remove.")],
             image_dir: ImageDir = None) -> None:
    """Remove a name. Content no other name has moves to the store's trash/ (running
    sandboxes keep it) until `tenon image prune`."""
    try:
        moved = _store(image_dir).remove(name)
    except (TenonError, OSError) as exc:
        fail(exc)
    console.print(f"removed {name}" + (f"; content {moved[0][:12]} moved to trash" if moved
                                       else "; its content has other names"))


@image_app.command("prune")
def image_prune(image_dir: ImageDir = None) -> None:
    """Delete removed or superseded content that no running process sandbox has as its root."""
    deleted = _store(image_dir).prune()
    console.print(f"deleted {len(deleted)} removed image(s)")
