"""Serving an artifact inside other serving engines: KServe (``kserve``: a serving runtime around
kserve's own ModelServer) and Ray Serve (``rayserve``: a deployment). Each imports only the loader
and its engine's package (the ``kserve`` and ``rayserve`` extras); ``served`` is what they share:
where the artifact is, loading it, and a call from named arrays to named outputs through the
loader's batcher.
"""
