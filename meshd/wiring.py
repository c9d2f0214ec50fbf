"""Which services a node runs, in start order (stopped in reverse).

WIRING POINT (services): each area adds its service here, one line each, so the daemon itself never
changes when a service lands. A service follows the contract in ``meshd/daemon.py`` (``name``,
``async start(daemon)``, ``async stop()``, ``status() -> dict``). Order matters: membership needs the
transport (started before any service), models before the API that routes to them.
"""

from __future__ import annotations

from meshd.api.service import ApiService
from meshd.config import DaemonConfig
from meshd.daemon import Service


def build_services(config: DaemonConfig) -> list[Service]:
    """The services for ``config`` (``config.role`` is ``serve`` or ``client``)."""
    services: list[Service] = []
    from meshd.membership.service import MembershipService

    services.append(MembershipService(config))  # membership / gossip / join (issue 3)
    # models and expert shards (issue 4/6), only when config.role == "serve"
    if config.role == "serve" and (config.experts or config.remote_experts != "off"):
        from meshd.experts_service import ExpertsService  # numpy and the engine only when needed

        services.append(ExpertsService.from_config(config))  # before models: they ask it for executors
    if config.role == "serve" and (config.stages or config.pipeline != "off"):
        from meshd.pipeline_service import PipelineService  # layer pipelines (issue 16)

        services.append(PipelineService.from_config(config))  # before the API: it asks for pipelined backends
    # OpenAI API (issue 5): it calls daemon.set_api_address(host, port) once bound
    services.append(ApiService(config))
    return services
