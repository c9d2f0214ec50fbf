"""Layer pipelines: one model split by contiguous layer ranges over several nodes (docs/pipeline.md).

``wire`` is the stage protocol's codec (sans-I/O), ``planner`` the pure placement function, ``stage`` what a
stage node runs (its layers, its KV caches keyed by (run, sequence)), ``client`` the serving node's
side: a model object the scheduler drives like a local ``engine.model.Model``.
"""
