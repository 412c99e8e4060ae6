"""Fixtures of the fault tests: a real 3-node Ray cluster on this host (tests/faults/cluster.py),
shared by a whole module, and the supervisor's database fixtures."""

from __future__ import annotations

import os

import pytest

from tests.supervisor.conftest import _templates, db, pg_admin  # noqa: F401 - fixtures re-exported

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, 1 CPU each (one rank per node), the driver connected.

    A pytest worker may already hold the local Ray of tests/trainer (one driver per process):
    it is shut down here and brought back afterwards, as tests/trainer/conftest.py starts it."""
    import ray

    from tests.faults.cluster import LocalCluster
    from tests.trainer.conftest import init_local_ray

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    c = LocalCluster()
    try:
        c.start_node("head", 1, head=True)
        c.start_nodes({"node_a": 1, "node_b": 1})
        ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="WARNING")
        c.wait_nodes(["head", "node_a", "node_b"])
        yield c
    finally:
        ray.shutdown()
        c.stop()
        if had_local:
            init_local_ray()
