"""The worker's loop: read -> admit -> pack -> device -> publish, parts joined by channels."""
