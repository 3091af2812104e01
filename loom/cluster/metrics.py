"""The ingress's /metrics: every replica's series with a `replica` label, and the cluster's own.

Replicas report their Prometheus exposition with their routing stats (replica.py); here each
sample gets the label ``replica="<id>"`` and the families are merged, so the usual vLLM
dashboards work per replica and summed (``sum without (replica) (...)``). The cluster adds:

    loom:prefix_cache_hit_rate{replica}    prefix-cache hits / queries of each replica (tokens)
    loom:cluster_prefix_cache_hit_rate     the same over all replicas
    loom:cluster_replicas                  replicas running (restarts show as a dip, then a new id)
    loom:cluster_routed_requests{replica,router}   requests this ingress routed to each replica
    loom:cluster_retries{reason}           requests sent again after a replica died or refused them
    loom:cluster_replica_failures          requests that met a dead replica
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _value(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{float(v):.1f}"


class _Families:
    """Families in first-seen order: name -> (type, help, sample lines)."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, kind: str, doc: str, sample: str, labels: Mapping[str, str], value: float) -> None:
        family = self.families.setdefault(name, (kind, doc, []))
        family[2].append(f"{sample}{_labels(labels)} {_value(value)}")

    def render(self) -> bytes:
        out: list[str] = []
        for name, (kind, doc, lines) in self.families.items():
            if kind == "counter":   # as prometheus_client writes it: the sample name in the header
                name += "_total"
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(lines)
        return ("\n".join(out) + "\n").encode()


def _hit_rate(hits: float, queries: float) -> float:
    return hits / queries if queries else 0.0


def cluster_exposition(replicas: Mapping[str, Mapping[str, Any]], routed: Mapping[str, int], router: str,
                       retries: Mapping[str, int], failures: int) -> bytes:
    """replicas: replica id -> its routing stats (with "metrics", its exposition text);
    routed: replica id -> requests routed to it; retries: reason -> count."""
    fam = _Families()
    for replica, stats in sorted(replicas.items()):
        for family in text_string_to_metric_families(str(stats.get("metrics", ""))):
            for s in family.samples:
                if s.name.endswith("_created"):   # creation times: noise once merged
                    continue
                fam.add(family.name, family.type, family.documentation, s.name,
                        {**s.labels, "replica": replica}, s.value)
    hits = queries = 0.0
    for replica, stats in sorted(replicas.items()):
        h, q = float(stats.get("prefix_cache_hits", 0)), float(stats.get("prefix_cache_queries", 0))
        hits, queries = hits + h, queries + q
        fam.add("loom:prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries (prompt tokens) of a replica.",
                "loom:prefix_cache_hit_rate", {"replica": replica}, _hit_rate(h, q))
    fam.add("loom:cluster_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries over all replicas.",
            "loom:cluster_prefix_cache_hit_rate", {}, _hit_rate(hits, queries))
    fam.add("loom:cluster_replicas", "gauge", "Replicas running.", "loom:cluster_replicas", {}, len(replicas))
    for replica, n in sorted(routed.items()):
        fam.add("loom:cluster_routed_requests", "counter", "Requests this ingress routed to a replica.",
                "loom:cluster_routed_requests_total", {"replica": replica, "router": router}, n)
    for reason in _reasons(retries):
        fam.add("loom:cluster_retries", "counter", "Requests sent again to another replica.",
                "loom:cluster_retries_total", {"reason": reason}, retries.get(reason, 0))
    fam.add("loom:cluster_replica_failures", "counter", "Requests that met a dead replica.",
            "loom:cluster_replica_failures_total", {}, failures)
    return fam.render()


def _reasons(retries: Mapping[str, int]) -> Iterable[str]:
    return sorted({"replica_died", "queue_full", *retries})
