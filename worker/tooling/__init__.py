"""Processes around the worker: the supervisor, ``tokenq up`` and the embedded Redis.

None of this runs inside the worker loop; it starts, restarts and stops
worker processes (and, for development, a redis-server).
"""
