"""Benchmarks: scripts that print figures (never timed assertions).

    python -m bench [--quick]     cold start, steady state, loader overhead and build, on real models
    python -m bench.overhead      the loader's Python overhead per call on the example classifier

The harness: ``cases`` (models and run sizes), ``workload`` (request streams, hand-bucketing
padding), ``coldstart`` and ``steady`` (drive the ``child_cold`` / ``child_steady`` processes),
``run`` (one model end to end) and ``report`` (JSON → Markdown + charts).
"""
