"""``python ray_node.py start --address 127.0.0.1:PORT ...``: Ray's own ``ray start``, for a
node that joins a head on this machine over loopback (the multi-node placement test).

Ray's CLI refuses to join a cluster unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is on, and
with it on it rewrites 127.0.0.1 (in ``--address`` and ``--node-ip-address``) to the machine's
outward address, where a head kept on loopback does not listen. This runs the same entry
point (``ray.scripts.scripts.main``) with that rewrite turned off; every flag is Ray's.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # before ray is imported
    import ray._private.services as services

    services.resolve_ip_for_localhost = lambda host: host
    services.get_node_ip_address = lambda address=None: "127.0.0.1"
    from ray.scripts.scripts import main

    sys.argv = ["ray", *sys.argv[1:]]
    main()
