"""The tests' own redis-server: the same launcher ``tokenq up`` uses."""

from tokenq.worker.embedded import RedisServer, find_redis_server, free_port

__all__ = ["RedisServer", "find_redis_server", "free_port"]
