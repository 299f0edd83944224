"""An E2B template id is an image name of the store: the official SDK picks the image a
sandbox runs on, `base` is tenon-base:bookworm, a name added while the server runs is offered
at once, and an unknown one is a 400 listing what the server offers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from tenon.errors import ImageNotFound
from tenon.sandbox.images import BASE_IMAGE, PYTHON_IMAGE, image_store
from tenon.service.testing import IMAGE_DIR, ServerHandle, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

HAS_PYTEST = "python3 -c 'import pytest; print(pytest.__version__)'"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    store = image_store(IMAGE_DIR)
    try:
        store.get(PYTHON_IMAGE)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    state = tmp_path_factory.mktemp("serve-templates") / "state"
    with running_server(state, budget="2GiB", backend="process") as handle:
        yield handle


@pytest.fixture
def sdk_env(server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> ServerHandle:
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return server


def test_the_template_id_picks_the_image(sdk_env: ServerHandle) -> None:
    python = Sandbox.create(template=PYTHON_IMAGE, timeout=120)
    try:
        assert python.commands.run(HAS_PYTEST).stdout.strip()[:1].isdigit()
        assert Sandbox.get_info(python.sandbox_id).template_id == PYTHON_IMAGE
    finally:
        python.kill()
    base = Sandbox.create(timeout=120)  # the SDK's default template: base
    try:
        with pytest.raises(CommandExitException, match="No module named 'pytest'"):
            base.commands.run(HAS_PYTEST)
    finally:
        base.kill()


def test_a_name_added_while_serving_is_offered_at_once(sdk_env: ServerHandle) -> None:
    store = image_store(IMAGE_DIR)
    name = f"tenon-templatetest-{uuid.uuid4().hex[:8]}:1"
    store.tag(name, BASE_IMAGE)
    try:
        sbx = Sandbox.create(template=name, timeout=120)
        try:
            assert sbx.commands.run("cat /etc/hostname").stdout == "sandbox\n"
        finally:
            sbx.kill()
    finally:
        assert store.remove(name) == []  # its content still has the base's name


def test_an_unknown_template_lists_what_the_server_offers(sdk_env: ServerHandle) -> None:
    r = httpx.post(f"{sdk_env.url}/v2/sandboxes", json={"templateID": "tenon-nope:1"},
                   headers={"X-API-Key": sdk_env.api_key})
    assert r.status_code == 400
    message = r.json()["message"]
    assert message.startswith("unknown template 'tenon-nope:1'; this server offers ")
    for offered in ("base", BASE_IMAGE, PYTHON_IMAGE):
        assert offered in message
