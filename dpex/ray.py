"""Dpex on a Ray cluster (``pip install 'dpex[ray]'``): a dispatcher and one
``dpex-worker`` per node, as named, detached Ray actors pinned to their nodes.

    import dpex.ray
    endpoint = dpex.ray.start()            # the Ray cluster this process belongs to
    loader = dpex.RemoteDataLoader(endpoint.address, spec, auth_token=endpoint.auth_token)
    dpex.ray.stop()

``DpexDataLoader(..., distribute_mode=True, head_address="auto")`` does the
start on its own when this machine belongs to a Ray cluster.
"""
from dpex.launch.ray import Endpoint, RayConfig, start, status, stop

__all__ = ["Endpoint", "RayConfig", "start", "status", "stop"]
