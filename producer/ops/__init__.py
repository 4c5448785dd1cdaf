"""Operator commands (``tokenq stats``, ``top``, ``dlq``, ``embed``): only ``tokenq.producer``'s
public API and ``tokenq.shared``, never torch, so they run on an operator's laptop."""
