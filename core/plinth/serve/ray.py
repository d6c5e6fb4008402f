"""``plinth serve`` replicas on a Ray cluster, behind Ray Serve's HTTP proxy.

Each replica is one ``plinth serve``: it loads the model once, runs its own scheduler
(continuous batching, speculative decoding) and answers the same OpenAI routes; Ray Serve
routes requests between replicas, restarts a replica that dies, and scales between
``num_replicas`` bounds. Two ways in:

* ``plinth serve -m MODEL --ray 2 [--ray-address ADDR] [--ray-max-replicas N] ...``: every
  ``plinth serve`` option applies to every replica;
* ``serve run plinth.cli:ray_serve_app args="-m MODEL --max-batch 8" replicas=2``: the
  same as a Ray Serve application (``args`` is a ``plinth serve`` command line, parsed by the CLI,
  which hands the options to :func:`deployment`).

Plugin selection (``PLINTH_PLUGINS``, ``PLINTH_DISABLE_PLUGINS``, ``PLINTH_PREFER``,
``PLINTH_STRICT_PLUGINS`` and the matching global options) reaches every replica through
the deployment's runtime environment, so all replicas run the same plugin set as the
command that deployed them. Needs the ``ray`` extra: ``pip install 'plinth[ray]'``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..errors import UserError, missing_extra
from ..pipeline import carried_env

#: what a parsed command line holds that is not an option (rebuilt on the replica)
_NOT_OPTIONS = ("registry", "func", "parser", "check_args")
DEPLOYMENT = "plinth"
_PLUGINS = "plugin_discovery"  # the field holding the plugin selection


def _ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise missing_extra("plinth on Ray", "ray", exc) from None
    return ray, serve


def replica_fields(args: argparse.Namespace, plugins: dict[str, Any]) -> dict[str, Any]:
    """The parsed ``plinth serve`` options a replica rebuilds its server from (plain values only), with
    ``plugins``: the :func:`plinth.plugins.discover` arguments the deploying command ran with."""
    fields = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    fields[_PLUGINS] = dict(plugins)
    return fields


class PlinthReplica:
    """One Ray Serve replica: a whole ``plinth serve`` (model, scheduler, OpenAI routes)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        from ..plugins import discover
        from .build import build_server

        fields = dict(fields)
        selection = fields.pop(_PLUGINS)
        args = argparse.Namespace(**fields)
        args.registry = discover(**selection)
        self.server = build_server(args)

    def __serve_build_asgi_app__(self) -> Any:
        from .app import build_app

        return build_app(self.server)  # Ray Serve runs its lifespan: the scheduler starts there


def deployment(fields: dict[str, Any], *, replicas: int = 1, max_replicas: int | None = None,
               cpus: float = 1.0, env: dict[str, str] | None = None) -> Any:
    """The bound Ray Serve application for ``plinth serve`` options ``fields``."""
    _, serve = _ray()
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": dict(env or {})}},
        # a replica takes as many requests as it decodes together; more wait in Ray Serve's
        # router for the first free replica (not in one replica's queue while another idles),
        # up to --max-queue, past which Ray Serve answers 503
        "max_ongoing_requests": int(fields.get("max_batch", 8)),
        "max_queued_requests": int(fields.get("max_queue", 32)),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
        # one line per request would drown the console; errors still show
        "logging_config": {"log_level": "WARNING", "enable_access_log": False},
    }
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas,
                                         "max_replicas": max_replicas,
                                         "target_ongoing_requests": int(fields.get("max_batch", 8))}
    else:
        options["num_replicas"] = replicas
    cls = serve.deployment(**options)(serve.ingress()(PlinthReplica))
    return cls.bind(fields)


def serve_on_ray(args: argparse.Namespace, plugins: dict[str, Any]) -> int:
    """``plinth serve --ray N``: deploy N replicas and serve until Ctrl-C (or SIGTERM); ``plugins``: the
    :func:`plinth.plugins.discover` arguments every replica loads its plugins with."""
    import signal

    ray, serve = _ray()

    if args.spec_synthetic is not None:
        raise UserError("--spec-synthetic is for benchmarks of `plinth generate`; a server must return the "
                        "model's own text")
    fields = replica_fields(args, plugins)
    fields["ray"] = None  # a replica is a plain server
    t0 = time.perf_counter()

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": carried_env()})
    try:
        # the HTTP proxy runs on the head node only: one address for clients (and nodes of a
        # one-machine test cluster share an IP, so a proxy per node would fight for the port)
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        app = deployment(fields, replicas=args.ray, max_replicas=args.ray_max_replicas, cpus=args.ray_cpus,
                         env=carried_env())
        try:
            serve.run(app, name="plinth", route_prefix="/", blocking=False)
        except RuntimeError as exc:  # a replica failed to start: its own error is in the log above
            raise UserError(f"Ray Serve could not start the plinth replicas ({str(exc).splitlines()[0]}); the "
                            "replicas' errors are printed above") from None
        scale = (f"{args.ray}-{args.ray_max_replicas} replicas (autoscaled)"
                 if args.ray_max_replicas and args.ray_max_replicas > args.ray else f"{args.ray} replica(s)")
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        print(f"plinth serve: {args.model_alias or args.model or 'the default model'} on Ray Serve, {scale} on a "
              f"cluster of {nodes} node(s), ready in {time.perf_counter() - t0:.1f} s on "
              f"http://{args.host}:{args.port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("plinth serve: stopping the Ray Serve application", file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
