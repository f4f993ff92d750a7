"""KV blocks beyond one rank's device cache: the KV spec a model family declares (spec.py: its streams, what the
block manager and the tiers work from), stable block hashes (hashing.py), the model's identity (identity.py), the host
and disk tiers of a stream (tier.py over host.py, disk.py; their LRU index, lru.py) behind one store over the streams
(store.py), what ranks tell the front about the blocks they hold (events.py), and KV-aware routing (router.py).
The [kv_cache] run-config section is KVCacheConfig (config.py)."""
from .config import KVCacheConfig
from .events import HeldLog, KVEvents
from .hashing import chain, prefix_chain
from .router import PrefixRouter

__all__ = ["KVCacheConfig", "HeldLog", "KVEvents", "chain", "prefix_chain", "PrefixRouter"]
