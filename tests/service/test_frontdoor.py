"""The front door over two real `tenon serve` nodes (process backend), driven only through
the official e2b SDK pointed at the front door; a third configured node never answers."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import httpx
import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    ServiceBusyException,
)

from tenon.service.frontdoor import FrontDoorSettings
from tenon.service.testing import ServerHandle, running_front_door, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

GIB = 1 << 30
NODE_BUDGET = "1GiB"
FRONT_KEY = "e2b_front_door_test_key"


@dataclass
class Cluster:
    url: str
    nodes: dict[str, ServerHandle]
    dead_url: str

    def settings(self) -> FrontDoorSettings:
        return make_settings(self.nodes, self.dead_url)

    def on_node(self, name: str) -> set[str]:
        """The sandboxes node `name` itself lists."""
        handle = self.nodes[name]
        listed = httpx.get(f"{handle.url}/v2/sandboxes", headers={"X-API-Key": handle.api_key})
        return {s["sandboxID"] for s in listed.json()}

    def get(self, path: str, **kwargs: object) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"X-API-Key": FRONT_KEY}, **kwargs)  # type: ignore[arg-type]


def make_settings(nodes: dict[str, ServerHandle], dead_url: str, **placement: object
                  ) -> FrontDoorSettings:
    # A long refresh: placements between readings spread by the front door's own
    # accounting (`with_agent`), which this file checks.
    return FrontDoorSettings.model_validate({
        "nodes": [*((name, h.url, h.api_key) for name, h in nodes.items()),
                  ("n3", dead_url, "e2b_unused")],
        "port": 0, "api_keys": [FRONT_KEY],
        "placement": {"refresh_s": 30.0, **placement}})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    dead_url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with running_server(root / "n1", budget=NODE_BUDGET, env={"TENON_NODE_NAME": "n1"}) as n1, \
            running_server(root / "n2", budget=NODE_BUDGET,
                           env={"TENON_NODE_NAME": "n2"}) as n2:
        nodes = {"n1": n1, "n2": n2}
        with running_front_door(make_settings(nodes, dead_url)) as url, _sdk_env(url):
            yield Cluster(url, nodes, dead_url)
        leftover = {name: Cluster(url, nodes, dead_url).on_node(name) for name in nodes}
    assert leftover == {"n1": set(), "n2": set()}, "tests left sandboxes"


def _sdk_env(url: str) -> Any:
    """Point the SDK at the front door only."""
    return mock.patch.dict(os.environ, {"E2B_API_URL": url, "E2B_SANDBOX_URL": url,
                                        "E2B_API_KEY": FRONT_KEY})


def test_nodes_publish_their_load(cluster: Cluster) -> None:
    n1 = cluster.nodes["n1"]
    load = httpx.get(f"{n1.url}/tenon/load", headers={"X-API-Key": n1.api_key}).json()
    assert (load["node"], load["budget_bytes"], load["alive"]) == ("n1", GIB, True)
    assert httpx.get(f"{n1.url}/tenon/load").status_code == 401
    nodes = {n["name"]: n for n in cluster.get("/tenon/nodes").json()["nodes"]}
    assert {name: n["load"]["alive"] for name, n in nodes.items()} == {
        "n1": True, "n2": True, "n3": False}
    assert nodes["n2"]["load"]["budget_bytes"] == GIB
    assert httpx.get(f"{cluster.url}/tenon/nodes").status_code == 401


def test_sandboxes_spread_over_nodes_and_work_through_one_endpoint(cluster: Cluster) -> None:
    sandboxes = [Sandbox.create(metadata={"suite": "frontdoor", "i": str(i)})
                 for i in range(4)]
    ids = {s.sandbox_id for s in sandboxes}
    try:
        on_n1, on_n2 = cluster.on_node("n1") & ids, cluster.on_node("n2") & ids
        assert on_n1, f"none on n1: {on_n2}"
        assert on_n2, f"none on n2: {on_n1}"
        assert on_n1 | on_n2 == ids

        merged = Sandbox.list(query=SandboxQuery(metadata={"suite": "frontdoor"}))
        assert {s.sandbox_id for s in merged.next_items()} == ids
        pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "frontdoor"}), limit=3)
        first, second = pages.next_items(), pages.next_items()
        assert (len(first), len(second), pages.has_next) == (3, 1, False)
        assert {s.sandbox_id for s in first + second} == ids

        # Connect server-streaming: output arrives while the command still runs.
        arrived: list[float] = []
        result = sandboxes[0].commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.6; done",
            on_stdout=lambda _: arrived.append(time.monotonic()))
        assert result.stdout == "line1\nline2\nline3\n"
        assert len(arrived) == 3
        assert arrived[-1] - arrived[0] > 0.9, "output held back until the command ended"

        payload = os.urandom(3 << 20)
        sandboxes[1].files.write("/workspace/blob.bin", payload)
        assert sandboxes[1].files.read("/workspace/blob.bin", format="bytes") == payload
        size = sandboxes[1].commands.run("stat -c %s /workspace/blob.bin").stdout
        assert int(size) == len(payload)

        sandboxes[2].files.write("/workspace/kept.txt", "kept")
        sandboxes[2].pause()
        assert sandboxes[2].get_info().state.value == "paused"
        resumed = Sandbox.connect(sandboxes[2].sandbox_id)
        assert resumed.get_info().state.value == "running"
        assert resumed.commands.run("cat /workspace/kept.txt").stdout == "kept"

        metrics = httpx.get(f"{cluster.url}/metrics").text
        placed = {node: _sample(metrics, f'tenon_frontdoor_placements_total{{node="{node}"}}')
                  for node in ("n1", "n2")}
        assert placed == {"n1": len(on_n1), "n2": len(on_n2)}
    finally:
        for sbx in sandboxes:
            sbx.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "frontdoor"})).next_items() == []
    gone = sandboxes[3]
    with pytest.raises(NotFoundException):
        Sandbox.connect(gone.sandbox_id)
    with pytest.raises(SandboxException, match="was not found"):  # sandbox-side, by header
        gone.commands.run("true")
    with pytest.raises(NotFoundException):
        Sandbox.get_info("doesnotexist0000")
    assert Sandbox.kill("doesnotexist0000") is False


def test_a_new_front_door_finds_existing_sandboxes(cluster: Cluster) -> None:
    """A restarted front door knows no sandbox until a call names one: it lists the nodes."""
    sbx = Sandbox.create()
    try:
        with running_front_door(cluster.settings()) as url, _sdk_env(url):
            again = Sandbox.connect(sbx.sandbox_id)
            assert again.commands.run("echo found").stdout == "found\n"
            nodes = httpx.get(f"{url}/tenon/nodes", headers={"X-API-Key": FRONT_KEY}).json()
            assert sum(n["sandboxes"] for n in nodes["nodes"]) >= 1
    finally:
        sbx.kill()


def test_loads_are_read_again_and_a_lost_node_gets_nothing(cluster: Cluster) -> None:
    """A placement counts on its node until the node's next reading; a node that stops
    answering is not alive at the next reading and is not chosen until it answers again."""
    settings = make_settings(cluster.nodes, cluster.dead_url, refresh_s=0.2)
    n2 = cluster.nodes["n2"]
    with running_front_door(settings) as url, _sdk_env(url):
        def nodes() -> dict[str, dict[str, Any]]:
            got = httpx.get(f"{url}/tenon/nodes", headers={"X-API-Key": FRONT_KEY}).json()
            return {n["name"]: n["load"] for n in got["nodes"]}

        peak = 100 << 20
        sbx = Sandbox.create(metadata={"tenon.profile_peak_bytes": str(peak)})
        try:
            where = next(name for name in ("n1", "n2") if sbx.sandbox_id in cluster.on_node(name))
            _eventually(lambda: nodes()[where]["queued_bytes"] == 0)  # read again
            assert nodes()[where]["live_agents"] >= 1

            n2.stop()
            _eventually(lambda: not nodes()["n2"]["alive"])
            others = [Sandbox.create() for _ in range(2)]
            try:
                assert {o.sandbox_id for o in others} <= cluster.on_node("n1")
            finally:
                for other in others:
                    other.kill()
        finally:
            if n2.proc is None:
                n2.start()
            _eventually(lambda: nodes()["n2"]["alive"])
            sbx.kill()


def _eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.1)


def test_no_room_is_a_retryable_503(cluster: Cluster) -> None:
    too_big = {"tenon.profile_peak_bytes": str(8 * GIB)}
    answer = httpx.post(f"{cluster.url}/sandboxes", json={"templateID": "base",
                                                          "metadata": too_big},
                        headers={"X-API-Key": FRONT_KEY})
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    message = answer.json()["message"]
    assert "n1: predicted peak 8192 MiB exceeds its budget 1024 MiB" in message
    assert "n2: predicted peak 8192 MiB" in message
    assert "n3: node lost" in message
    assert "retryable" in message
    with pytest.raises(ServiceBusyException, match="exceeds its budget"):
        Sandbox.create(metadata=too_big, retries=0)
    bad = httpx.post(f"{cluster.url}/sandboxes",
                     json={"templateID": "base",
                           "metadata": {"tenon.profile_peak_bytes": "lots"}},
                     headers={"X-API-Key": FRONT_KEY})
    assert bad.status_code == 400
    assert "tenon.profile_peak_bytes" in bad.json()["message"]
    assert cluster.on_node("n1") == cluster.on_node("n2") == set()
    refusals = _sample(httpx.get(f"{cluster.url}/metrics").text,
                       "tenon_frontdoor_refusals_total")
    assert refusals >= 2


def test_the_front_door_checks_its_own_keys(cluster: Cluster) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key=cluster.nodes["n1"].api_key)  # a node's key is not the door's


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_settings_reject_unknown_keys_and_duplicate_nodes() -> None:
    node = ("n1", "http://127.0.0.1:1", "k")
    with pytest.raises(ValueError, match="unique"):
        FrontDoorSettings.model_validate({"nodes": [node, node], "api_keys": ["k"]})
    with pytest.raises(ValueError, match="extra"):
        FrontDoorSettings.model_validate({"nodes": [node], "api_keys": ["k"], "nodez": 1})
    with pytest.raises(ValueError, match="at least 1"):
        FrontDoorSettings.model_validate({"nodes": [node], "api_keys": []})
    settings = FrontDoorSettings.model_validate({"nodes": [node], "api_keys": ["k"]})
    assert (settings.nodes[0].name, settings.nodes[0].url) == node[:2]
