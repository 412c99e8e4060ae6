"""Which Ray nodes a "restart without the outlier" rollback excludes, and whether the cluster
can still hold the gang without them (issue 13, item 4).

The run keeps its world size: the excluded node's ranks move to spare capacity, so the data
split, the global batch and the checkpoint's ZeRO partitioning stay as they are (a shrunk gang
would need the batch to divide by the new world size and a ZeRO re-partition on load). Without
spare capacity the command is refused before anything changes, and the message says so.
"""

from __future__ import annotations

from typing import Any


def nodes_to_exclude(ctl: Any, rank: int | None, node: str | None) -> list[str]:
    """Ray node ids for (rank, node): the rank's node in the live gang, and `node` given as a
    node id, an IP or a node name (every alive node that matches). Raises ValueError, naming
    the problem, when neither resolves or the remaining nodes cannot hold the gang."""
    import ray

    cfg = ctl.cfg
    node_ids = getattr(ctl.gang, "node_ids", None)
    if node_ids is None:
        raise ValueError("this gang does not run on Ray nodes (in-process rank): there is no node to exclude")
    alive = [n for n in ray.nodes() if n.get("Alive")]
    out: list[str] = []
    if rank is not None:
        if rank not in node_ids:
            raise ValueError(f"exclude_rank={rank} is not a rank of this gang (world size {cfg.world_size})")
        out.append(node_ids[rank])
    hosts = getattr(ctl.gang, "hosts", {})
    if node and rank is not None and node in (node_ids.get(rank), hosts.get(rank)):
        node = None  # the policy names the rank's host too: that rank's node, not every node at that IP
    if node:
        match = [n["NodeID"] for n in alive if node in (n["NodeID"], n.get("NodeManagerAddress"), n.get("NodeName"))]
        if not match:
            raise ValueError(f"exclude_node={node!r} names no alive Ray node (give a node id, IP or node name)")
        out += [m for m in match if m not in out]
    banned = set(out) | set(ctl.excluded_nodes)
    left = [n for n in alive if n["NodeID"] not in banned]
    per_rank = {"CPU": cfg.cpus_per_rank, **({"GPU": 1} if cfg.use_gpu else {})}
    # Total resources of the nodes left (the gang's own are freed when it is replaced).
    fits = [min(int(n["Resources"].get(k, 0) // v) for k, v in per_rank.items()) for n in left]
    room = sum(1 for f in fits if f > 0) if cfg.placement == "STRICT_SPREAD" else sum(fits)
    if cfg.placement == "STRICT_PACK":
        room = max(fits, default=0)
    if room < cfg.world_size:
        raise ValueError(
            f"without node(s) {sorted(banned)} the cluster holds {room} rank(s) of {per_rank} "
            f"({'one per node, ' if cfg.placement == 'STRICT_SPREAD' else ''}placement {cfg.placement}), "
            f"fewer than world_size={cfg.world_size}; add a node (the run keeps its world size) or drain "
            "the node and relaunch by hand")
    return out
