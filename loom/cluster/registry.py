"""The request routers living in this process, for the ingress to read their replicas' stats.

Its own module on purpose: Ray Serve ships a router class to the ingress by value
(cloudpickle registers router.py's module by value), so a module-level registry inside
router.py would be a private copy per unpickled class; this module is imported by name.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(router: Any) -> None:
    _ROUTERS.add(router)


def routers_of(deployment: str) -> list[Any]:
    """The routers of this process that route to `deployment` (one per handle)."""
    return [r for r in list(_ROUTERS) if getattr(r, "deployment_name", None) == deployment]
