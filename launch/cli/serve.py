"""`wideep serve` on every rank: the Engine built from the run config; rank 0 serves HTTP
(launch/server/app.py serve_front), every other rank follows rank 0's steps in engine.run_worker_loop()
until rank 0 calls engine.shutdown()."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

from ..server import chat_http
from ..server.app import DEFAULT_HOST, DEFAULT_PORT, serve_front
from wideep.parallel.join import JOIN_ENV

from . import run_config
from .spawn_link import Spawner


# serve's chunked-prefill budget on CPU when the run config sets none (the library's LLM / Engine keep 8192, as
# vLLM keeps a smaller budget for its server than for its LLM class). Measured with `bench/vs_vllm.py
# --wideep-budgets` (one core, bf16, 128 in / 64 out, docs/benchmarks.md): at concurrency 64, 2048 against 8192
# gives TTFT p50 1015 ms instead of 1497 at the same TPOT p50 (64.6 / 63.0 ms) and throughput (771 / 760 tok/s);
# at concurrency 16 the two are equal; 1024 and 512 lower TTFT further (692 / 533 ms) at 13 / 18 % more TPOT.
SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 2048


def serving_defaults(kwargs: dict) -> dict:
    """The engine options serve applies where the run config is silent: the CPU budget above (not on CUDA, and
    not for prefill/decode pools, which size their own steps)."""
    import torch
    device = kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if kwargs.get("disagg") is None and "max_num_batched_tokens" not in kwargs and str(device).startswith("cpu"):
        kwargs = dict(kwargs, max_num_batched_tokens=SERVE_CPU_MAX_NUM_BATCHED_TOKENS)
    return kwargs


def serve(cfg: dict) -> int:
    """Every rank: build the Engine from the run config; rank 0 serves HTTP, the others follow it."""
    from wideep.engine.front.engine import Engine
    from wideep.parallel import launch_rank
    if launch_rank() != 0:
        # torchrun and Ctrl-C signal every rank at once. A worker that died first would leave rank 0's
        # graceful shutdown waiting for a lost rank; instead workers leave when rank 0 shuts down
        # (or, if rank 0 dies, when the watchdog says so). Set before the model loads: rank 0 may
        # serve, and be signalled, while a slower worker is still loading.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    kwargs = serving_defaults(run_config.llm_kwargs(cfg))
    if kwargs.get("disagg") is not None:  # prefill/decode pools: rank 0 (the front) is a decode rank
        from wideep.disagg import make_engine
        engine = make_engine(**kwargs)
    elif JOIN_ENV in os.environ:          # started by the supervisor for a resize that grows the deployment
        from wideep.engine.worker.join import join
        engine = Engine(kwargs["model"], joined=join(os.environ, **kwargs))
    else:                                 # rank 0 of `wideep serve --dp-size N` may ask its supervisor for ranks
        engine = Engine(**kwargs, spawner=Spawner.from_env(os.environ) if launch_rank() == 0 else None)
    if not engine.is_front:
        engine.run_worker_loop()
        return 0
    s = cfg.get("server", {})
    rc = asyncio.run(serve_front(engine, s.get("host", DEFAULT_HOST), s.get("port", DEFAULT_PORT),
                                 s.get("model_name"), s.get("api_key"), s.get("protect_metrics", False),
                                 under_torchrun="TORCHELASTIC_RUN_ID" in os.environ,
                                 allowed_origins=tuple(s.get("allowed_origins") or ()),
                                 chat={k: s[k] for k in chat_http.OPTIONS if k in s}))
    if rc and engine.job_ctx.world_size > 1:
        # The step loop died (a lost rank, most often): the process group may be broken, and finalizing the
        # interpreter would run its destructors (SIGABRT from a joinable gloo thread) or block in them. Leave
        # as the watchdog does, with the status that says the server failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
