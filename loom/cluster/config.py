"""What `loom serve --replicas N` deploys, checked before Ray is touched."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from loom.config import physical_cores
from loom.errors import LoomError

ROUTER_NAMES = ("prefix-aware", "power-of-two")
REACH_TIMEOUT_S = 3.0
UNBOUNDED_ONGOING = 10_000   # replicas take what Ray sends; the engine's --max-waiting answers 429
# Ray Serve autoscaling_config keys `--autoscaling-config` may set beside the three options
# (seconds, or factors), each a number >= 0
AUTOSCALING_EXTRA_KEYS = ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s",
                          "upscaling_factor", "downscaling_factor")


class ClusterConfigError(LoomError):
    """A bad --replicas / --threads / autoscaling / router option."""


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 1
    threads: int = 1                       # CPUs (torch threads) per replica
    ray_address: str | None = None         # None: start a local Ray for this command
    min_replicas: int | None = None        # any of these three turns on Ray Serve autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    router: str = "prefix-aware"
    autoscaling_extra: tuple[tuple[str, float], ...] = ()   # further autoscaling_config keys, checked
    stats_period_s: float = 1.0            # how often replicas report their stats to the routers

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ClusterConfigError(f"--replicas must be at least 1, got {self.replicas}")
        if self.threads < 1:
            raise ClusterConfigError(f"--threads must be at least 1, got {self.threads}")
        if self.router not in ROUTER_NAMES:
            raise ClusterConfigError(f"--router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0:
            raise ClusterConfigError(f"--min-replicas must be at least 0, got {lo}")
        if hi is not None and hi < max(1, lo or 0):
            raise ClusterConfigError(f"--max-replicas must be at least 1 and at least --min-replicas, got {hi}")
        if self.autoscaling and not (lo or 0) <= self.replicas <= self.max_count:
            raise ClusterConfigError(f"--replicas {self.replicas} (the initial count) must lie within "
                                     f"--min-replicas {lo or 0} and --max-replicas {self.max_count}")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ClusterConfigError(f"--target-ongoing-requests must be positive, got {self.target_ongoing_requests}")
        self._check_autoscaling_extra()

    def _check_autoscaling_extra(self) -> None:
        if self.autoscaling_extra and not self.autoscaling:
            raise ClusterConfigError("--autoscaling-config needs autoscaling on: give --min-replicas, "
                                     "--max-replicas or --target-ongoing-requests")
        for key, value in self.autoscaling_extra:
            if key not in AUTOSCALING_EXTRA_KEYS:
                raise ClusterConfigError(f"--autoscaling-config: unknown key {key!r} (known: "
                                         f"{', '.join(AUTOSCALING_EXTRA_KEYS)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ClusterConfigError(f"--autoscaling-config: {key} must be a number >= 0, got {value!r}")

    @property
    def autoscaling(self) -> bool:
        return (self.min_replicas, self.max_replicas, self.target_ongoing_requests) != (None, None, None)

    @property
    def max_count(self) -> int:
        """The most replicas this deployment may run."""
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def check_before_ray(self) -> None:
        """The checks that need the machine or the network (not Ray): cores for a local Ray, a
        reachable address for an existing one."""
        if self.ray_address is None:
            check_local_cores(self)
        else:
            check_reachable(self.ray_address)

    def replica_options(self) -> dict[str, Any]:
        """`serve.deployment` options of the replica deployment (but the router's)."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.threads},
                                   "max_ongoing_requests": UNBOUNDED_ONGOING,
                                   "health_check_period_s": 2, "health_check_timeout_s": 30,
                                   "graceful_shutdown_timeout_s": 5,
                                   # a model that does not load fails the same way again: fail fast
                                   "max_constructor_retry_count": self.max_count + 1}
        if self.autoscaling:
            auto: dict[str, Any] = {"min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                                    "max_replicas": self.max_count, "initial_replicas": self.replicas}
            if self.target_ongoing_requests is not None:
                auto["target_ongoing_requests"] = self.target_ongoing_requests
            auto.update(self.autoscaling_extra)
            options["autoscaling_config"] = auto
        else:
            options["num_replicas"] = self.replicas
        return options


def check_local_cores(cluster: ClusterConfig) -> None:
    cores = physical_cores()
    if cluster.threads > cores:
        raise ClusterConfigError(f"--threads {cluster.threads} is more than this machine's {cores} cores")
    need = cluster.max_count * cluster.threads
    if need > cores:
        raise ClusterConfigError(f"{cluster.max_count} replicas x {cluster.threads} threads need {need} cores; "
                                 f"this machine has {cores} (lower --replicas/--max-replicas or --threads, "
                                 f"or join a cluster with --ray-address)")


def check_reachable(address: str) -> None:
    """Fails within seconds, in one line, when nothing listens at a Ray address."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterConfigError(f"--ray-address must be HOST:PORT (or ray://HOST:PORT, or auto), got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterConfigError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None
