"""``precompile serve``: an HTTP service on the loader (FastAPI under uvicorn, the ``serve`` extra).

    config.py   ServeConfig: what one server process needs to know
    codec.py    request bodies to arrays (numpy or torch, per --runtime) and outputs back; schema, body limit
    errors.py   the exception policy: which exceptions are the client's (4xx), which the server's (5xx)
    limits.py   the body size limit, in front of every endpoint
    reload.py   what POST /v1/reload may ask for and which paths it may load
    metrics.py  the Prometheus metrics and their registry
    service.py  Service: one served model (Live, batcher, metrics labels) and the exception policy's answer
    repository.py  the models the routes look up by name: a repository of models and versions, or one artifact
    calls.py    the front door every protocol's model call goes through: find, describe, run, count
    app.py      create_app(): the endpoints, model loading and warm-up, hot swap, traffic recording
    server.py   run(): uvicorn, one process or several workers
    workers.py  the --workers supervisor: spawned workers, each with its own SO_REUSEPORT socket
    instances.py     execution instances: calls at once per model, each thread its own OpenMP team
    handoff.py       results from those threads (and the batcher's) to the event loop, one wake-up per batch
    grpc_service.py  the Open Inference Protocol over gRPC (messages: predict_v2_pb2, from predict_v2.proto)

Only ``config`` imports nothing beyond the standard library; the rest needs ``pip install 'precompile[serve]'``.
"""
