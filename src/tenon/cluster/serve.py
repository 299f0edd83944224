"""`tenon cluster serve`: one serving Tenon per Ray node and one E2B front door.

Each node's Tenon runs as a Ray actor pinned to its node (`cluster.ray_nodes`) and serves
E2B's API over its own runtime on its node's address; the front door
(`service.frontdoor`) places each new sandbox on a node by predicted headroom and routes
every later call to that node. Clients know only the front door.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ray

from tenon.cluster.node import NodeSpec
from tenon.cluster.ray_nodes import RayNode, alive_node_ids, start_nodes
from tenon.errors import ConfigError
from tenon.service.frontdoor import FrontDoorSettings, NodeSettings, serve_front_door
from tenon.service.server import DEFAULT_IMAGE


@contextlib.asynccontextmanager
async def serving_nodes(specs: list[NodeSpec], *, image: str = DEFAULT_IMAGE
                        ) -> AsyncIterator[list[tuple[RayNode, NodeSettings]]]:
    """Start one serving Tenon per spec on the cluster's live nodes (Ray initialised);
    yields each node's handle and front-door settings; stops them all on exit."""
    ids = alive_node_ids()
    if len(specs) > len(ids):
        raise ConfigError(f"{len(specs)} nodes asked for, the Ray cluster has {len(ids)}")
    nodes = await start_nodes(specs, ids)
    try:
        served = []
        for node in nodes:
            key = f"e2b_{secrets.token_hex(20)}"
            url = await node.actor.serve.remote(key, image)
            served.append((node, NodeSettings(name=node.name, url=url, api_key=key)))
        yield served
    finally:
        for node in nodes:
            await node.stop()


async def serve_cluster(*, node_budget_bytes: int, num_nodes: int, address: str | None,
                        shared_dir: Path, image_dir: Path, host: str, port: int,
                        api_key: str, ready: Callable[[str], Any] | None = None) -> None:
    """Serve until SIGINT or SIGTERM: on the Ray cluster at `address` (one node per live
    Ray node when `num_nodes` is 0), or on a local multi-node test cluster."""
    from tenon.cluster.bench import local_cluster

    stack = contextlib.ExitStack()
    if address is None:
        if num_nodes < 1:
            raise ConfigError("--nodes: give the number of nodes of the local test cluster")
        stack.enter_context(local_cluster(num_nodes, node_budget_bytes,
                                          shared_dir / "ray-tmp"))
    else:
        ray.init(address=address, namespace="tenon", log_to_driver=False)
        stack.callback(ray.shutdown)
    with stack:
        count = num_nodes or len(alive_node_ids())
        specs = [NodeSpec(name=f"n{i}", budget_bytes=node_budget_bytes,
                          node_dir=shared_dir / f"n{i}", image_dir=image_dir,
                          keep_agents=True) for i in range(count)]
        async with serving_nodes(specs) as served:
            settings = FrontDoorSettings(nodes=tuple(s for _, s in served), host=host,
                                         port=port, api_keys=(api_key,))
            await serve_front_door(settings, ready=ready)
