"""`loom serve MODEL --replicas N`: the replica and ingress deployments on Ray Serve.

    check the options, the model file and the Ray address    # one-line errors, before Ray starts
    ray.init(address or a local Ray with this machine's cores)
    serve.start(HTTP on host:port); serve.run(ingress -> replicas)   # waits for every replica
    wait for SIGINT / SIGTERM
    serve.shutdown() (local Ray) or serve.delete(app) (a shared cluster); ray.shutdown()

A local Ray is started by and for this command, so stopping it leaves no process behind; on
an existing cluster (`--ray-address`) only this command's application is removed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
from typing import Any

import ray
from ray import serve

from ray.serve.config import RequestRouterConfig

from loom.cluster.config import UNBOUNDED_ONGOING, ClusterConfig, ClusterConfigError
from loom.cluster.ingress import REPLICA_DEPLOYMENT, IngressSettings, LoomIngress
from loom.cluster.replica import LoomReplica, ReplicaSpec
from loom.cluster.router import ROUTERS
from loom.config import EngineConfig, physical_cores
from loom.errors import LoomError
from loom.loader.gguf import GGUFFile
from loom.loader.registry import resolve_model
from loom.server.limits import Cors
from loom.server.openai_api import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("loom.cluster")

APP_NAME = "loom"
LOCAL_OBJECT_STORE_BYTES = 128 << 20   # requests and answers are small; the models live in the replicas
DRAIN_SECONDS = 5.0                    # at a stop, what open requests get to finish or end their streams


class _Stop(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. A KeyboardInterrupt: Ray's native code, which checks for
    signals while it waits, lets only that kind through (anything else became a SystemError)."""


def run_cluster(config: EngineConfig, cluster: ClusterConfig, *, host: str = "127.0.0.1", port: int = 8000,
                api_key: str | None = None, served_model_name: str | None = None,
                max_tokens_limit: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                log_level: str = "info", access_log: bool = True, cors: Cors | None = Cors(),
                chat_template: str | None = None) -> None:
    """Serves `config`'s model on `cluster.replicas` Ray Serve replicas until interrupted."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if log_level != "debug":
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    _check_model(config)
    cluster.check_before_ray()
    local = cluster.ray_address is None
    if local:
        _check_port(host, port)
    signals = _Signals()
    previous = {sig: signal.signal(sig, signals.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _init_ray(cluster, log_level)
        signal.signal(signal.SIGINT, signals.handle)     # ray.init may install its own handlers
        signal.signal(signal.SIGTERM, signals.handle)
        signals.check()
        _check_capacity(cluster)
        spec = ReplicaSpec(config, api_key=api_key, served_model_name=served_model_name,
                           max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes,
                           chat_template=chat_template)
        _start_serve(host, port, log_level)
        signals.check()
        _deploy(build_application(spec, cluster, max_body_bytes, access_log, log_level, cors))
        signals.serving()
        log.info("serving %s on http://%s:%d with %d replica(s) x %d thread(s), %s routing",
                 config.load.model, host, port, cluster.replicas, cluster.threads, cluster.router)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):   # ours; Ray's handler during ray.init exits with the signal
        log.info("stopping the replicas")
    finally:
        for sig in previous:   # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        _stop(local)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_application(spec: ReplicaSpec, cluster: ClusterConfig, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                      access_log: bool = True, log_level: str = "info", cors: Cors | None = Cors()):
    """The Serve application: the ingress bound to the replica deployment."""
    logging_config = {"log_level": "DEBUG" if log_level == "debug" else "WARNING",
                      "enable_access_log": access_log}
    router = RequestRouterConfig(request_router_class=ROUTERS[cluster.router],
                                 request_routing_stats_period_s=cluster.stats_period_s,
                                 request_routing_stats_timeout_s=10.0)
    replicas = serve.deployment(LoomReplica, name=REPLICA_DEPLOYMENT).options(
        request_router_config=router, logging_config=logging_config, **cluster.replica_options())
    ingress = serve.deployment(serve.ingress()(LoomIngress), name="LoomIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=UNBOUNDED_ONGOING,
        logging_config=logging_config)
    return ingress.bind(replicas.bind(spec), IngressSettings(router=cluster.router, max_body_bytes=max_body_bytes,
                                                             cors=cors, api_key=spec.api_key))


class _Signals:
    """SIGINT / SIGTERM. While Ray starts, a stop waits for the step under way (a Ray call cut
    by an exception had left its native state broken: aborts and segfaults at the shutdown,
    processes behind) and a second signal quits at once; once serving, a stop is immediate."""

    def __init__(self) -> None:
        self.requested = False
        self.running = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.running:
            raise _Stop()
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        log.warning("stopping once the step of the start-up under way ends (again to quit at once)")

    def check(self) -> None:
        if self.requested:
            raise _Stop()

    def serving(self) -> None:
        self.check()
        self.running = True


def _check_port(host: str, port: int) -> None:
    """The local Ray's HTTP proxy listens on host:port: a port in use is one line before Ray starts."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        raise ClusterConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _start_serve(host: str, port: int, log_level: str) -> None:
    try:
        serve.start(http_options={"host": host, "port": port},
                    logging_config={"log_level": "WARNING" if log_level != "debug" else "DEBUG"})
    except ray.exceptions.RayError as e:
        bind = re.search(r"Failed to bind to address[^\n]*", str(e))
        raise LoomError(f"cannot start the HTTP proxy on {host}:{port}: "
                        f"{bind.group(0) if bind else str(e).splitlines()[0]}") from None


def _check_model(config: EngineConfig) -> None:
    """A missing or unreadable model fails here, in one line, before any replica starts."""
    GGUFFile.open(resolve_model(config.load.model))


def _init_ray(cluster: ClusterConfig, log_level: str) -> None:
    quiet = log_level != "debug"
    common: dict[str, Any] = {"logging_level": logging.WARNING if quiet else logging.DEBUG,
                              "log_to_driver": not quiet, "configure_logging": True}
    if cluster.ray_address is None:
        ray.init(address="local", num_cpus=physical_cores(), include_dashboard=False,   # never a stale cluster file
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, **common)
    else:
        try:
            ray.init(address=cluster.ray_address, **common)
        except (ConnectionError, RuntimeError) as e:
            raise ClusterConfigError(f"cannot join the Ray cluster at {cluster.ray_address}: "
                                     f"{_join_error(e)}") from None


def _join_error(e: BaseException) -> str:
    """Ray's reason in one line; a missing token is said with its remedy."""
    chain = [e, e.__cause__, e.__cause__.__cause__ if e.__cause__ is not None else None]
    if any(isinstance(c, ray.exceptions.AuthenticationError) for c in chain if c is not None):
        return ("the cluster requires its authentication token: set RAY_AUTH_MODE=token and give the head "
                "node's token (its ~/.ray/auth_token) as ~/.ray/auth_token or RAY_AUTH_TOKEN here")
    return str(e).splitlines()[0]


def _check_capacity(cluster: ClusterConfig) -> None:
    cpus = int(ray.cluster_resources().get("CPU", 0))
    need = (cluster.min_replicas if cluster.autoscaling and cluster.min_replicas is not None
            else cluster.replicas) * cluster.threads
    if need > cpus:
        raise ClusterConfigError(f"{need} CPUs are needed for the replicas ({cluster.threads} thread(s) each); "
                                 f"the Ray cluster has {cpus}")


def _deploy(app) -> None:
    """serve.run, with a replica's model error as the one-line error instead of Ray's report."""
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:
        raise LoomError(_deploy_error("\n".join([str(e), *_deployment_messages()]))) from None


def _deployment_messages() -> list[str]:
    """Ray Serve's status messages of the application's deployments (a failed replica's
    traceback is there)."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - only used to word an error
        return []
    if app is None:
        return []
    return [app.message or ""] + [d.message or "" for d in app.deployments.values()]


def _deploy_error(text: str) -> str:
    found = re.findall(r"ReplicaLoadError: (.+)", text)
    if found:
        return f"a replica could not load the model: {found[-1].strip()}"
    missing = re.findall(r"No module named '(loom[\w.]*)'", text)
    if missing:
        return (f"the Ray workers cannot import {missing[-1]}: install this loom version on every node "
                f"of the cluster")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"the deployment failed: {lines[-1] if lines else 'no reason given'}"


def _stop(local: bool) -> None:
    """Ends open streams with an error event (the ingress drains), then the application; a local
    Ray is shut down even when it was stopped half-way through starting (its processes would be
    left behind)."""
    if ray.is_initialized():
        _drain()
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        except Exception as e:  # noqa: BLE001 - Ray is going away anyway
            log.warning("stopping the Serve application failed: %s", e)
    if local or ray.is_initialized():
        ray.shutdown()


def _drain(timeout_s: float = DRAIN_SECONDS) -> None:
    try:
        handle = serve.get_deployment_handle("LoomIngress", app_name=APP_NAME)
        handle.drain.remote(timeout_s).result(timeout_s=timeout_s + 5)
    except Exception as e:  # noqa: BLE001 - not deployed yet, or already gone: nothing to drain
        log.debug("draining the ingress: %s", e)
