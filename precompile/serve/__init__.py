"""``precompile serve``: an HTTP service on the loader (FastAPI under uvicorn, the ``serve`` extra).

    config.py   ServeConfig: what one server process needs to know
    codec.py    request bodies to arrays (numpy or torch, per --runtime) and outputs back; schema, body limit
    errors.py   the exception policy: which exceptions are the client's (4xx), which the server's (5xx)
    limits.py   the body size limit, in front of every endpoint
    reload.py   what POST /v1/reload may ask for and which paths it may load
    metrics.py  the Prometheus metrics and their registry
    app.py      create_app(): the endpoints, model loading and warm-up, hot swap, traffic recording
    server.py   run(): uvicorn, one process or several workers

Only ``config`` imports nothing beyond the standard library; the rest needs ``pip install 'precompile[serve]'``.
"""
