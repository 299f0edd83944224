"""Build an image from a Dockerfile on the local Docker daemon, then import it into the store.

Nothing is pulled: every base a `FROM` names must be in Docker already, or in the target
store or the default one (it is then loaded into Docker first); a missing one is an
ImageNotFound saying how to get it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tenon.errors import ConfigError, ImageNotFound
from tenon.sandbox.images.store import ImageStore, StoredImage, normalize_name

_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.IGNORECASE)


class BuildFailed(ConfigError):
    """The Dockerfile's build failed (with the step's error)."""


def dockerfile_bases(text: str) -> list[str]:
    """The images the stages of a Dockerfile start from, other than `scratch`, earlier
    stages and names built from build arguments."""
    bases: list[str] = []
    stages: set[str] = set()
    joined = re.sub(r"\\\s*\n", " ", text)
    for line in joined.splitlines():
        match = _FROM.match(line)
        if match is None:
            continue
        base, alias = match.group(1), match.group(2)
        if base.lower() != "scratch" and base.lower() not in stages and "$" not in base:
            bases.append(base)
        if alias:
            stages.add(alias.lower())
    return bases


def _require_bases(client: object, bases: list[str], store: ImageStore,
                   dockerfile: Path) -> None:
    from tenon.sandbox.images.docker_sync import ensure_in_docker

    images = client.images  # type: ignore[attr-defined]
    for base in bases:
        try:
            images.get(base)
            continue
        except Exception:  # noqa: BLE001 - docker's ImageNotFound or a name it refuses
            pass
        holder = next((s for s in (store, ImageStore()) if normalize_name(base) in s.names()),
                      None)
        if holder is not None:  # in Tenon's store: loaded into Docker for the build
            ensure_in_docker(base, store=holder)
            continue
        raise ImageNotFound(
            f"base image {base!r} of {dockerfile} is not present locally and nothing is "
            f"pulled; import it (tenon image import IMAGE.tar|OCI-DIR --name {base}) or "
            f"build it (tenon image build -f ITS-DOCKERFILE --name {base}) first")


def build_dockerfile(dockerfile: Path, context: Path | None = None, *, name: str,
                     store: ImageStore | None = None) -> StoredImage:
    """Build `dockerfile` (context: its directory unless given) as `name`, tagged so in
    Docker too, and import the result into the store."""
    import docker

    from tenon.sandbox.dockerd import connect
    from tenon.sandbox.images.importer import import_from_docker

    store = store or ImageStore()
    full = normalize_name(name)
    if not dockerfile.is_file():
        raise ConfigError(f"-f {dockerfile}: no such file")
    context = context if context is not None else dockerfile.parent
    if not context.is_dir():
        raise ConfigError(f"build context {context}: not a directory")
    client = connect(timeout_s=600)
    try:
        _require_bases(client, dockerfile_bases(dockerfile.read_text()), store, dockerfile)
        try:
            client.images.build(path=str(context.resolve()),
                                dockerfile=str(dockerfile.resolve()), tag=full,
                                pull=False, rm=True, forcerm=True)
        except docker.errors.BuildError as exc:
            raise BuildFailed(f"building {dockerfile} failed: {_last_line(str(exc))}") from exc
        except docker.errors.APIError as exc:
            raise BuildFailed(f"building {dockerfile} failed: {_last_line(str(exc))}") from exc
    finally:
        client.close()
    return import_from_docker(full, name=full, store=store)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"
