"""Online engine for serving stacks: add_request / step / abort, continuous batching on every DP rank.

Every rank builds the Engine (SPMD). Global rank 0 is also the front (engine/front/front.py): it validates
requests, routes each to the DP rank with the fewest tokens in flight, and turns the ranks' reports
into RequestOutputs. Each rank runs its own step loop (engine/worker/rank_loop.py) — rank 0's on a thread
beside the front, the others in run_worker_loop() — and the ranks keep the MoE all-to-alls in
lockstep through one small all-reduce per step; requests and outputs travel asynchronously
(engine/worker/channel.py), so no rank ever waits for the front.

    engine = Engine(model=dir, kv_cache_blocks=..., block_size=64, max_num_seqs=..., enable_prefix_caching=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""
from __future__ import annotations

import threading
import time
import uuid

from wideep.kvstore.router import PrefixRouter
from wideep.parallel.join import JOIN_ENV, Ticket
from wideep.parallel.watchdog import RankLostError, raise_if_lost

from ..sampling_params import RequestOutput, SamplingParams
from ..worker.channel import FrontChannel, RankChannel, agree_name, local_pair
from ..worker.core import EngineCore
from ..worker.messages import END, SHUTDOWN, NewRequest
from ..worker.rank_loop import RankHooks, RankLoop
from .front import Domain, Front
from .health import HealthView
from .outputs import RequestState
from .resize import JOIN_TIMEOUT_S, ResizeError, check_size, plan_members
from .samples import SampleGroup, sample_id, sample_params


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more (a rank's loop failed, or it was shut down)."""


class Engine:
    """Options (LLM takes the same): see engine/engine_config.py (EngineConfig's fields, plus
    parallel / dp_size / ep_size / dispatch_backend), and progress (a load bar on rank 0), ctx (a
    ParallelContext already bootstrapped: this engine then runs on its ranks)."""

    def __init__(self, model: str, *, ctx=None, progress: bool = True, job_ctx=None, hooks: RankHooks | None = None,
                 domains: list[Domain] | None = None, spawner=None, joined=None, **options):
        """job_ctx, hooks, domains: for engines that run on part of a job (disaggregation's pools):
        ctx is then this engine's own ranks (a pool), job_ctx the whole job (channels, the front on
        its rank 0), domains the job's lockstep groups in global ranks (default: one, every rank).
        spawner (rank 0): what starts ranks for a resize that grows the deployment (launch/cli/spawn_link.py
        Spawner: .most, .start(origins, world, env)); None: it cannot grow. joined: a rank that joined a
        running deployment (engine/worker/join.py); the options are then the ones it was built with."""
        self.core = joined.core if joined is not None else EngineCore.from_options(model, ctx=ctx, progress=progress,
                                                                                    **options)
        self._job_ctx = job_ctx          # None: the engine's own (core.ctx, which a loss may re-form)
        self._spawner = spawner
        job = self._job
        domains = domains or [Domain(list(range(job.world_size)))]
        if job.is_single:
            front_end, rank_end = local_pair()
        else:
            self._channel_name = name = joined.channel if joined is not None else agree_name(job)
            rank_end = RankChannel(job, name)
            front_end = FrontChannel(job, list(range(job.world_size)), name) if job.rank == 0 else None
        leader = any(d.ranks[0] == job.rank for d in domains)
        self.loop = RankLoop(self.core, rank_end, job.origin_rank, leader, hooks=hooks)
        if joined is not None:
            self.loop.joined(joined.stats)
        router = PrefixRouter.from_config(self.core.cfg.kv_cache, self.core.cfg.block_size,
                                          self.core.cfg.enable_prefix_caching)
        self.front = Front(front_end, domains, self.core.tokenizer, router=router) if job.rank == 0 else None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._closed = False
        self._health = HealthView()

    @property
    def ctx(self):
        return self.core.ctx

    @property
    def _job(self):
        return self._job_ctx if self._job_ctx is not None else self.core.ctx

    @property
    def is_front(self) -> bool:
        return self._job.origin_rank == 0

    @property
    def job_ctx(self):
        """The context of the whole job (a pool's engine has its pool's as ctx)."""
        return self._job

    # -- front API (rank 0) -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and send a request to its DP rank. Errors leave the engine as it was."""
        request_id, text, ids, params, max_tokens = self._accept(request_id, prompt, params)
        domain = self.front.domains[0]
        if params.n > 1:
            self._add_samples(domain, request_id, text, ids, params, max_tokens)
            return
        rank = self.front.assign(domain, request_id, len(ids) + max_tokens, ids=ids)
        st = RequestState(request_id, text, ids, params, max_tokens, rank, eos_token_ids=self.core.config.eos_token_ids)
        self._ensure_worker()
        self.front.add(st, NewRequest(request_id, ids, params, max_tokens, st.arrival_time))

    def _add_samples(self, domain, request_id: str, text, ids: list[int], params: SamplingParams,
                     max_tokens: int) -> None:
        """n > 1: n sequences on one rank sharing the prompt's blocks (engine/front/samples.py)."""
        group = SampleGroup(request_id)
        msgs = []
        rank = None
        for i in range(params.n):
            sid, sp = sample_id(request_id, i), sample_params(params, i)
            cost = len(ids) + max_tokens
            if rank is None:
                rank = self.front.assign(domain, sid, cost, ids=ids)
            else:
                self.front.book(domain, sid, rank, cost)
            st = RequestState(sid, text, ids, sp, max_tokens, rank, index=i, group=group,
                              eos_token_ids=self.core.config.eos_token_ids)
            group.states.append(st)
            msgs.append(NewRequest(sid, ids, sp, max_tokens, st.arrival_time))
        self._ensure_worker()
        # Sharing needs a full block of prompt to name in the prefix cache. With prompt logprobs the
        # others wait too: sample 0 carries them, and an echoed prompt's choices must all have them.
        cfg = self.core.cfg
        hold = (cfg.enable_prefix_caching and len(ids) > cfg.block_size) or params.prompt_logprobs is not None
        self.front.add_group(group, msgs, hold=hold)

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and cache; -> its max_tokens."""
        return self.core.validate(ids, params)

    def _accept(self, request_id, prompt, params: SamplingParams | None) -> tuple:
        """Front-side checks that change nothing. -> (request_id, text, ids, params, max_tokens)."""
        self._front_only("add_request")
        self._check_alive()
        request_id = str(request_id)
        if self.front.is_live(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams) and params.n > 1 and any(
                self.front.is_live(sample_id(request_id, i)) for i in range(params.n)):
            raise ValueError(f"duplicate request id: a sample of {request_id!r} has the id of a live request")
        if isinstance(params, SamplingParams) and params.stop and self.core.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer (no tokenizer.json); use stop_token_ids")
        text, ids = self.core.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        self.core.check_grammar(params)   # structured outputs: a bad spec fails here, before admission
        return request_id, text, ids, params, max_tokens

    def abort(self, request_id: str) -> None:
        self._front_only("abort")
        request_id = str(request_id)
        if not self.front.is_live(request_id):
            raise ValueError(f"unknown request id {request_id!r} (never added, or already finished)")
        self.front.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.front.requests)

    def step(self, timeout_s: float = 0.05) -> list[RequestOutput]:
        """-> a RequestOutput for every request that advanced (or finished) since the last call.
        One process: runs one step here. Several ranks: the ranks step on their own; this waits up
        to timeout_s for their next reports."""
        self._front_only("step")
        if self._job.is_single:
            if self.loop.pending():
                self.loop.run_once()
            return self.front.poll(0)
        self._check_alive()
        if self.front.joining is not None:   # a grow waits for its new ranks to load (the others serve on)
            self.front.check_joiners()
        outs = self.front.poll(timeout_s if self.front.requests or self.front.resizing else 0)
        if not outs:
            self._check_alive()
        return outs

    # -- resizing on request (engine/front/resize.py, engine/worker/resize.py) -------------------------------
    def start_resize(self, new_data_parallel_size) -> dict | None:
        """Begin resizing to new_data_parallel_size ranks: a shrink drains the last ranks (their requests move to
        the others, recomputed; they exit). -> None while it runs (step() drives it, resize_result() gives its
        figures once the new shape serves); the figures at once when the size is today's. Requests keep being
        accepted meanwhile. Raises ResizeError (a bad size, a deployment that cannot resize) or ResizeConflict
        (one is running), changing nothing."""
        self._front_only("start_resize")
        self._check_alive()
        current = list(self.front.domains[0].ranks)
        sp = self._spawner
        n = check_size(new_data_parallel_size, len(current), self.front.resizing is not None, self._resize_refusal(),
                       sp.most if sp is not None else len(current), self._grow_refusal())
        if n == len(current):
            return {"old_data_parallel_size": n, "new_data_parallel_size": n, "members": current, "left": [],
                    "resize_s": 0.0, "requests_moved": 0}
        self._ensure_worker()
        if n < len(current):
            self.front.start_resize(plan_members(current, n))
            return None
        joiners = list(range(self.front.next_origin, self.front.next_origin + n - len(current)))
        ctx = self.core.ctx
        ticket = Ticket(uuid.uuid4().hex, tuple(current + joiners), ctx.epoch + 1, self._channel_name,
                        self.core.cfg.parallel.dp_size)
        ticket.publish(ctx.store)
        try:
            sp.start(joiners, n, {JOIN_ENV: ticket.name})
        except Exception as e:   # SpawnError, or the link broke: nothing started, nothing changed
            raise ResizeError(f"cannot grow from {len(current)} to {n} ranks: the launcher could not start ranks: "
                              f"{e}") from None
        self.front.await_joiners(ticket, joiners, time.monotonic() + JOIN_TIMEOUT_S)
        return None

    def resize_result(self) -> dict | None:
        """-> the running resize's figures once the new shape serves (once), else None. Raises ResizeFailed when
        a grow's new ranks could not join (the deployment serves on unchanged)."""
        self._front_only("resize_result")
        return self.front.finish_resize()

    @property
    def resizing(self) -> bool:
        return self.front is not None and self.front.resizing is not None

    def _grow_refusal(self) -> str | None:
        """Why this deployment cannot start ranks (None: its launcher can)."""
        if self._spawner is not None:
            return None
        how = {"mpirun": "mpirun -n", "torchrun": "torchrun --nproc-per-node"}.get(self._job.launcher)
        if how is None:
            return "this engine's ranks were not started by a launcher that can add ranks"
        return (f"{self._job.launcher} started this deployment and cannot add ranks to a running job; restart it "
                f"with more ranks ({how} M ... wideep serve ...), or start it without a launcher (`wideep serve "
                f"MODEL --dp-size N`), whose supervisor starts ranks on request")

    def _resize_refusal(self) -> str | None:
        if self._job.is_single:
            return ("this engine runs in one process: resizing needs data-parallel ranks (wideep serve --dp-size N, "
                    "torchrun or mpirun)")
        if self._job_ctx is not None or len(self.front.domains) > 1:
            return ("a disaggregated deployment (prefill/decode pools) cannot be resized: its pools are fixed at "
                    "start-up; restart it with the pool sizes you want")
        return None

    def end_worker_loop(self) -> None:
        """Rank 0: every rank leaves its loop (in one step); run_worker_loop returns "end" elsewhere."""
        self._command(END)

    def shutdown(self) -> None:
        """Rank 0: every rank leaves its loop, then the process group. Others: leave it."""
        if self._closed:
            return
        if self.is_front and not self._job.is_single and self._thread_error is None:
            self._command(SHUTDOWN)
        self.close()

    def close(self) -> None:
        """Close this rank's channels and leave the process group, telling no one (SPMD code where
        every rank closes at once: LLM.shutdown)."""
        if self._closed:
            return
        self._closed = True
        self.core.close()
        self.loop.channel.close()
        if self.front is not None:
            self.front.channel.close()
        if not self._job.is_single:
            from wideep.parallel import shutdown
            shutdown(self._job)

    # -- workers ------------------------------------------------------------------------------------
    def run_worker_loop(self) -> str:
        """Ranks other than 0: step until rank 0 ends the loop ("end"), shuts down ("shutdown") or a resize
        drops this rank ("left")."""
        if self.is_front:
            raise RuntimeError("run_worker_loop is for ranks other than 0")
        done = self.loop.run()
        if done == "shutdown":
            self.shutdown()
        elif done == "left":   # a resize dropped this rank: it already left the process group
            self.close()
        return done

    # -- rank 0's own loop --------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        """Rank 0's step loop runs on a thread, so the front (this thread) never holds the ranks up."""
        if self._job.is_single or (self._thread is not None and self._thread.is_alive()):
            return

        def run():
            try:
                self.loop.run()
            except BaseException as e:  # a lost rank, a failed step: the front raises it to its callers
                self._thread_error = e

        self._thread = threading.Thread(target=run, name="wideep-rank0", daemon=True)
        self._thread.start()

    def _command(self, kind: int) -> None:
        if not self.is_front or self._job.is_single:
            return
        self._ensure_worker()
        self.front.command(kind)
        self._thread.join()
        self._raise_thread_error()

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("engine is shut down")
        self._raise_thread_error()
        if self._job.on_rank_loss != "continue":   # else: the loop re-forms the groups
            raise_if_lost(self._job)

    def _raise_thread_error(self) -> None:
        if self._thread_error is not None:
            e = self._thread_error
            if isinstance(e, RankLostError):
                raise e
            raise EngineDeadError(f"rank 0's step loop failed: {e!r}") from e

    def _front_only(self, what: str) -> None:
        if not self.is_front:
            raise RuntimeError(f"{what} is for rank 0 (the front); this is rank {self._job.rank}")

    # -- metrics ------------------------------------------------------------------------------------
    def metrics(self, window_s: float = 10.0) -> dict:
        """Engine-wide (rank 0): running/waiting, KV blocks, prefix-cache hit rate, tokens/s over the
        last window_s seconds, per-rank stats, per-request TTFT/TPOT/queue time of finished requests."""
        self._front_only("metrics")
        if self._job.is_single and not self.front.rank_stats:
            self.front.rank_stats[0] = self.core.stats()
        h = self.health()
        return dict(self.front.metrics(window_s), serving=int(h["serving"]), lost_ranks=h["lost_ranks"],
                    unreachable=h.get("unreachable", []))

    def extra_stats(self) -> dict:
        """What an engine built on this one adds to LLM.stats() (disaggregation: its KV transfers)."""
        return {}

    def reset_extra_stats(self) -> None:
        """Zero what extra_stats() counts (`wideep run`: after its warm-up)."""

    def health(self) -> dict:
        """Rank 0, on the thread that steps the engine: whether the deployment serves and the ranks
        lost (engine/front/health.py)."""
        self._front_only("health")
        return self._health.read(self)
