"""kvops.engine: a compact serving engine on the kvops runtime, and trace replay.

- :mod:`~kvops.engine.request`: :class:`Request` and its lifecycle;
- :mod:`~kvops.engine.traces`: Azure / Mooncake / ShareGPT loaders and the shipped synthetic trace;
- :mod:`~kvops.engine.scheduler`: continuous batching, chunked prefill, demotion before
  preemption, preemption by recompute or swap;
- :mod:`~kvops.engine.kv`: KV through the Pager (:class:`PagedKV`) or a static arena (:class:`StaticKV`);
  :mod:`~kvops.engine.elastic_kv`, :mod:`~kvops.engine.offload_kv`,
  :mod:`~kvops.engine.reserve_kv`: ElasticKV's Fidelity, swap preemption, worst-case reservation;
- :mod:`~kvops.engine.runner`: the forwards through kvops ops, CUDA graphs per decode bucket;
- :mod:`~kvops.engine.configs`: ``static``, ``pager``, ``pager+merge``, ``kvrm``, ``paged``,
  ``elastic``, ``offload``, ``reserve``;
- :mod:`~kvops.engine.engine`: the loop; :mod:`~kvops.engine.metrics`: vLLM bench-serve metrics;
- :mod:`~kvops.engine.replay`: replays across configurations, tables and figures (``kvops replay``);
  :mod:`~kvops.engine.pressure`: ElasticKV's pressure sweep (``kvops replay --mode elastic``).
"""

from kvops.engine.configs import CONFIGS, KVBudget, make_kv
from kvops.engine.engine import Engine
from kvops.engine.request import Request, Status
from kvops.engine.scheduler import SchedulerConfig

__all__ = ["CONFIGS", "Engine", "KVBudget", "Request", "SchedulerConfig", "Status", "make_kv"]
