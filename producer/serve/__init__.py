"""``tokenq serve``: an HTTP gateway that speaks the APIs embedding clients already call.

It holds no model: each request becomes one ``infer_many`` on the queue its ``model`` names,
through one :class:`~tokenq.producer.AsyncClient` per queue; it never imports torch.
"""
