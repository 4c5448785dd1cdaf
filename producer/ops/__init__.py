"""Operator commands: ``tokenq stats``, ``top``, ``dlq`` and ``embed``.

They sit beside the client library, not inside it: each one uses only the
producer's public API (``tokenq.producer``) and the record formats in
``tokenq.shared``, and none imports torch, so they run on an operator's laptop.
"""
