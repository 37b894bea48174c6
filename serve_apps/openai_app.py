"""`aerie serve`: the OpenAI-compatible endpoint as a Ray Serve application.

Each replica holds one `aerie.serving.OpenAIService`: ONE engine stepped by its own loop thread,
so every concurrent request joins the same continuous batch while the replica's event loop keeps
streaming. The FastAPI ingress is built by the service (`aerie.serving.http.create_app`) once the
replica has loaded its model; this file is only the Ray wiring: the deployment and its options
(replicas or autoscaling, resources, the per-replica request bound), metrics through
`ray.serve.metrics`, `check_health` (fails when the engine loop has died, so Serve replaces the
replica), a graceful shutdown that flushes the captured traffic, and three ways to start it:

- `deploy(cfg)`: deploy on the current Ray cluster and wait until the endpoint answers;
- `run(cfg)`: `deploy`, then block until Ctrl-C / SIGTERM (`aerie serve`);
- `build_app(args)`: the application builder `serve deploy` / `serve run` import
  (``import_path: serve_apps.openai_app:build_app``, `args` = `ServeConfig` fields).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import ray
from ray import serve
from ray.serve import Application

from aerie.serving.config import ServeConfig
from aerie.serving.deploy_configs import with_absolute_paths
from aerie.serving.http import create_app
from aerie.serving.service import OpenAIService
from serve_apps.metrics import ServeMetrics

DEPLOYMENT = "OpenAIEndpoint"


@serve.deployment(health_check_period_s=10, health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
@serve.ingress()
class OpenAIEndpoint:
    def __init__(self, config: ServeConfig) -> None:
        self.service = OpenAIService(config, observer=ServeMetrics(), log=logging.getLogger("ray.serve"))

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    def check_health(self) -> None:
        self.service.check_health()

    def __del__(self) -> None:
        self.service.close()


def application(config: ServeConfig) -> Application:
    """The Serve application for a config (not yet deployed)."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
    }
    if config.autoscaling is not None:
        options["autoscaling_config"] = config.autoscaling.model_dump()
    else:
        options["num_replicas"] = config.num_replicas
    return OpenAIEndpoint.options(**options).bind(with_absolute_paths(config))


def build_app(args: dict[str, Any]) -> Application:
    """The builder behind ``import_path: serve_apps.openai_app:build_app`` (args: `ServeConfig`)."""
    return application(ServeConfig.model_validate(args))


def base_url(config: ServeConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    return f"http://{host}:{config.port}{config.route_prefix.rstrip('/')}"


def deploy(config: ServeConfig, timeout_s: float = 600.0) -> str:
    """Deploy on the current Ray cluster (``ray.init()`` if needed; Serve's HTTP proxy on
    ``config.host:config.port``), wait until ``/health`` answers, return the base URL."""
    config.resolved()  # a missing or invalid winner.json fails here, before anything is started
    if not ray.is_initialized():
        ray.init()
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        serve.run(application(config), name=config.name, route_prefix=config.route_prefix)
    except Exception:
        serve.delete(config.name)
        raise
    url = base_url(config)
    _wait_healthy(url, timeout_s)
    return url


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as error:
            last = error
        time.sleep(0.25)
    raise RuntimeError(f"the endpoint did not answer {url}/health within {timeout_s:.0f} s ({last}); is Serve "
                       "already running on this cluster with other HTTP options? (`serve status`)")


def run(config: ServeConfig, announce: Callable[[str], None] = print) -> None:
    """`aerie serve`: deploy, then block until Ctrl-C or SIGTERM; then delete the application
    (replicas drain their requests and write their captured traffic) and stop what was started."""
    started_ray = not ray.is_initialized()
    url = deploy(config)
    announce(f"serving {config.resolved().served_model} at {url}/v1 (Ctrl-C to stop)")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.delete(config.name)
        if started_ray:
            serve.shutdown()
            ray.shutdown()
