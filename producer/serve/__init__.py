"""``tokenq serve``: an HTTP gateway that speaks the APIs embedding clients already call.

It holds no model. Each HTTP request becomes one ``infer_many`` on the
queue its ``model`` names (``--models name=queue,...``; by default every name
is served by ``--queue``), through one shared
:class:`~tokenq.producer.AsyncClient` per queue, so any number of replicas
can stand behind a load balancer while GPU workers elsewhere answer. It is
the producer side: it never imports torch.

Modules: :mod:`.errors` (every failure as the status and body each API
gives), :mod:`.schemas` (embedding request bodies and answers, per API),
:mod:`.scores` (TEI's ``/rerank`` and ``/predict``), :mod:`.app` (the
routes and the per-queue clients), :mod:`.cli` (the command).
"""
