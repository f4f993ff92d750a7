"""MoE token dispatch/combine over the EP group: the interface and its counters (base.py), the
handle each backend gives combine (handles.py), one backend per file (local, torch_normal +
torch_low_latency, allgather, deepep) and make_dispatcher (factory.py), which picks one when the
model is built."""
from .base import Dispatched, Dispatcher, DispatchStats, Pending
from .factory import make_dispatcher
from .local import LocalDispatcher

__all__ = ["Dispatched", "Dispatcher", "DispatchStats", "LocalDispatcher", "Pending", "make_dispatcher"]
