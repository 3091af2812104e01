"""The engines `loom bench` knows, how to name them on the command line, and whether each is installed.

A peer spec is ``KIND`` or ``KIND:VARIANT``: ``loom`` (loom with its default dtype),
``loom:DTYPE`` (an explicit dtype, e.g. ``loom:float32``; the engine validates it), ``loom:kv=KV``
or ``loom:DTYPE+kv=KV`` (a KV cache dtype, e.g. ``loom:kv=int8``),
``transformers``, ``llama.cpp``.
Adapters are imported only inside their worker process, so a missing package never breaks the
harness; it is reported as skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loom.bench.settings import BenchError, Capacity

if TYPE_CHECKING:
    from loom.bench.peers.base import Peer


@dataclass(frozen=True)
class PeerKind:
    """An engine family: the modules it needs, its pip package and its adapter class."""

    name: str
    requires: tuple[str, ...]   # importable module names; any missing -> skipped (not installed)
    package: str                # what to pip install, for the skip message
    adapter: str                # "module:Class" implementing `Peer`
    variant_option: str | None = None  # the option a ``:VARIANT`` suffix sets, if variants exist
    variants: tuple[str, ...] | None = ()  # allowed variants; None = any (the engine validates)


PEER_KINDS: dict[str, PeerKind] = {
    k.name: k
    for k in (
        PeerKind("loom", ("torch",), "loom", "loom.bench.peers.loom_peer:LoomPeer",
                 variant_option="dtype", variants=None),
        PeerKind("transformers", ("transformers", "torch", "gguf"), "transformers",
                 "loom.bench.peers.transformers_peer:TransformersPeer"),
        PeerKind("llama.cpp", ("llama_cpp",), "llama-cpp-python", "loom.bench.peers.llamacpp_peer:LlamaCppPeer"),
    )
}
DEFAULT_PEERS = ("loom", "transformers", "llama.cpp")


@dataclass(frozen=True)
class PeerSpec:
    """One column of the report: an engine kind plus its options, named as the user typed it."""

    label: str
    kind: PeerKind
    options: dict[str, str]

    @property
    def is_loom(self) -> bool:
        return self.kind.name == "loom"

    def with_option(self, key: str, value: str) -> "PeerSpec":
        """The same column with one more engine option."""
        return PeerSpec(self.label, self.kind, {**self.options, key: value})


def parse_peers(text: str | list[str] | tuple[str, ...]) -> list[PeerSpec]:
    """``"loom,llama.cpp"`` -> specs, in order, without duplicates; BenchError for unknown names."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs: list[PeerSpec] = []
    for raw in (s.strip() for s in items):
        if not raw or any(s.label == raw for s in specs):
            continue
        name, _, variant = raw.partition(":")
        kind = PEER_KINDS.get(name)
        if kind is None:
            raise BenchError(f"unknown peer '{name}' (known: {', '.join(PEER_KINDS)}; "
                             f"loom also takes loom:DTYPE)")
        options: dict[str, str] = {}
        if variant:
            if kind.variant_option is None or (kind.variants is not None and variant not in kind.variants):
                allowed = ", ".join(f"{name}:{v}" for v in kind.variants or ()) or "none"
                raise BenchError(f"peer '{raw}': unknown variant '{variant}' (allowed: {allowed})")
            for part in variant.split("+") if kind.name == "loom" else [variant]:
                key, eq, value = part.partition("=")
                if eq and key == "kv":
                    options["kv_cache_dtype"] = value
                elif eq:
                    raise BenchError(f"peer '{raw}': unknown option '{key}' (loom takes DTYPE and kv=KV)")
                else:
                    options[kind.variant_option] = part
        specs.append(PeerSpec(raw, kind, options))
    if not specs:
        raise BenchError("--peers names no engine")
    return specs


def missing_modules(kind: PeerKind) -> list[str]:
    """The required modules of `kind` that cannot be found (nothing is imported)."""
    missing = []
    for module in kind.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def not_installed(kind: PeerKind, missing: list[str]) -> dict[str, str]:
    """The report entry of an engine whose package is missing: skipped, never estimated."""
    return {"status": "skipped", "reason": "not installed",
            "hint": f"no module {', '.join(missing)}; pip install {kind.package}"}


def create_peer(kind: PeerKind, model_path: Path, threads: int, capacity: Capacity,
                options: dict[str, str]) -> "Peer":
    """Instantiate the adapter of `kind` (imports the engine's package)."""
    module, _, cls = kind.adapter.partition(":")
    return getattr(importlib.import_module(module), cls)(model_path, threads, capacity, dict(options))
