"""What a service adds on top of the loader's core: dynamic batching (``batch``: the ``Batcher``
thread; ``batch_plan``, which calls run together and at what shape; ``idle``, which idle worker takes the next call; ``batch_tensors``, joining inputs
and cutting outputs), hot swap (``live``) and shape recording (``traffic``).

Optional: it imports the core (``loader.dispatch``, ``loader.manifest``, ...) and the stores (``live``
watches a pointer in a store), and the core imports nothing of it (``lint-imports`` checks both).
``loader.Batcher``, ``loader.Live``, ``loader.TrafficRecorder`` and the rest are imported from here
on first use.
"""
