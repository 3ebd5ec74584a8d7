"""pdserve.cluster: the only package that knows Ray and Redis.

Importing it sets Ray's loopback environment (see ``ray_env.set_loopback_env``) before any of
its modules imports ray.
"""

from pdserve.cluster.ray_env import set_loopback_env

set_loopback_env()
