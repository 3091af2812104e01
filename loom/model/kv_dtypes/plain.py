"""float32 and float16 KV caches: the values as they are."""

from __future__ import annotations

import torch

from loom.model.kv_dtypes.base import KVFormat

FLOAT32 = KVFormat("float32", 0, torch.float32)
FLOAT16 = KVFormat("float16", 0, torch.float16)
