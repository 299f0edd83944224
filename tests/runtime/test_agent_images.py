"""An agent asks for its image by name: `create_agent(image=...)` runs on any image of the
store, from a state directory that holds no images, and an unknown name fails its first
action with the names there are."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound
from tenon.runtime.open import open_runtime
from tenon.sandbox.images import PYTHON_IMAGE, ImageStore

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups, pytest.mark.disk]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    try:
        ImageStore().get(PYTHON_IMAGE)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    # under /var/lib/tenon: the sandboxes' ids must be able to reach their mounts
    path = Path("/var/lib/tenon") / f"test-images-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_agents_run_on_the_image_they_name(run_dir: Path) -> None:
    # the state directory has no images/: the runtime finds the default store
    async with open_runtime(budget_bytes=1 << 30, backend="process", state_dir=run_dir,
                            policy="tenon") as rt:
        python = await rt.create_agent(image=PYTHON_IMAGE)
        result = await python.run("python3 -m pytest --version", timeout=60)
        assert result.exit_code == 0, result.output
        assert "pytest" in result.output
        await python.close()
        unknown = await rt.create_agent(image="tenon-nope:1")
        with pytest.raises(ImageNotFound, match=r"unknown image 'tenon-nope:1'; images in "
                           r"\S+: .*tenon-python:bookworm"):
            await unknown.run("true", timeout=60)
        await unknown.close()
