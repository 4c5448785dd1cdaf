"""``tokenq serve``: an HTTP gateway that speaks the APIs embedding clients already call. It
holds no model and never imports torch: each request becomes one ``infer_many`` on a queue."""
