"""Scale-out: N engine replicas behind one OpenAI-compatible route, with Ray Serve.

Each replica is a Ray actor holding one :class:`AsyncEngine` and the same FastAPI app as
``cbatch serve``; Ray Serve's proxy spreads requests over the replicas (one per GPU with
``num_gpus_per_replica=1``; on the CPU they share the machine).

    import cbatch
    cbatch.serve("gpt2", num_replicas=2, port=8000)     # or: cbatch serve --num-replicas 2

Every response carries the replica that served it in the ``x-cbatch-replica`` header.
"""

from __future__ import annotations

from ray import serve as ray_serve


@ray_serve.ingress()
class EngineReplica:
    """One engine and its app; Ray Serve builds the app once the engine is up."""

    def __init__(self, model: str, served_model_name: str | list[str], max_waiting: int,
                 engine_kwargs: dict, chat_template: str | None = None,
                 guard: dict | None = None):
        from cbatch.entrypoints.openai.api_server import build_engine

        self.model_name, self.chat_template = served_model_name, chat_template
        self.guard = guard or {}
        self.engine, self.metrics = build_engine(model, max_waiting, served_model_name,
                                                 **engine_kwargs)
        self.replica_id = ray_serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        from cbatch.entrypoints.openai.api_server import build_app

        app = build_app(self.engine, self.metrics, self.model_name,
                        chat_template=self.chat_template, **self.guard)
        replica_id = self.replica_id

        @app.middleware("http")
        async def tag_replica(request, call_next):
            response = await call_next(request)
            response.headers["x-cbatch-replica"] = replica_id
            return response

        return app


def build_ray_app(model: str, num_replicas: int = 1,
                  served_model_name: str | list[str] | None = None,
                  num_cpus_per_replica: float = 1.0, num_gpus_per_replica: float = 0.0,
                  max_waiting: int = 1024,
                  chat_template: str | None = None, guard: dict | None = None,
                  **engine_kwargs):
    """The Ray Serve application (not started): ``num_replicas`` copies of the engine.
    Engine keywords are those of :class:`cbatch.config.EngineConfig` (``threads`` keeps
    replicas that share a CPU from oversubscribing it); ``chat_template``
    (Jinja) replaces the checkpoint's; ``guard`` holds ``build_app``'s request-guard keywords
    (API key, allowed hosts, body limits)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    deployment = ray_serve.deployment(
        EngineReplica, name="cbatch", num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus_per_replica, "num_gpus": num_gpus_per_replica},
        # at most this many requests in flight per replica; beyond it the proxy queues them
        max_ongoing_requests=max(1, engine_kwargs.get("max_num_seqs", 64)) * 4)
    return deployment.bind(model, served_model_name or model, max_waiting, engine_kwargs,
                           chat_template, guard)


def check_gpus(num_replicas: int, num_gpus_per_replica: float, device: str | None) -> None:
    """Raise ValueError unless the Ray cluster (started here if none is) has the GPUs the
    replicas ask for: Ray Serve would otherwise wait for them forever, saying nothing."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init()
    have = ray.cluster_resources().get("GPU", 0.0)
    needed = num_replicas * num_gpus_per_replica
    problem = None
    if str(device or "").startswith("cuda") and have == 0:
        problem = f"device={device!r} but the Ray cluster has no GPU"
    elif needed > have:
        problem = (f"{num_replicas} replica(s) x num_gpus_per_replica={num_gpus_per_replica:g} "
                   f"need {needed:g} GPU(s) but the Ray cluster has {have:g}")
    if problem is not None:
        if started_here:
            ray.shutdown()
        raise ValueError(f"{problem}; Ray Serve would wait for them forever "
                         "(use device='cpu', num_gpus_per_replica=0 on a machine without one)")


def serve(model: str, num_replicas: int = 1, host: str = "127.0.0.1", port: int = 8000,
          blocking: bool = True, **kwargs) -> None:
    """Start Ray Serve on ``host:port`` with ``num_replicas`` engines (``kwargs``: those of
    :func:`build_ray_app`).  ``blocking`` serves until interrupted, then shuts Serve down.
    Raises ValueError at once when the cluster lacks the GPUs asked for."""
    check_gpus(num_replicas, kwargs.get("num_gpus_per_replica", 0.0), kwargs.get("device"))
    ray_serve.start(http_options={"host": host, "port": port})
    ray_serve.run(build_ray_app(model, num_replicas, **kwargs), name="cbatch", route_prefix="/",
                  blocking=blocking)
