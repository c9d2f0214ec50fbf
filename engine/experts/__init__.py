"""Distributed expert workers: expert RPC codec, fingerprint, ownership, shards, worker and coordinator
(with its worker links and request planning).

See docs/experts.md. ``engine.moe`` is the seam: the coordinator is an ``ExpertExecutor`` and the worker
calls the same ``expert_ffn`` the local path does.
"""
