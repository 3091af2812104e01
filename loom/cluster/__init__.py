"""Scale-out on Ray Serve: `loom serve MODEL --replicas N` (docs/cluster.md).

    HTTP -> Ray Serve proxy -> LoomIngress (ingress.py) --DeploymentHandle--> LoomReplica x N (replica.py)
                                            request router: router.py (prefix-aware, or power of two)

`run_cluster` (launch.py) is the command; the modules import Ray, so import them only when
a cluster is asked for.
"""
