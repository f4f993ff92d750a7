"""One rank's step loop: inbox -> schedule -> step sync -> forward -> apply -> report.

Every rank runs its own loop (rank 0 on a thread beside the front). The only thing a step waits
for is the step sync's fixed-size all-reduce and the model's own all-to-alls; requests arrive in the
inbox and outputs leave as Reports without any rank waiting for another (engine/worker/channel.py).

Waves. When the sync says no rank of the domain (the ranks in lockstep) has work, every rank goes
idle at the same step: wave += 1, and the loop blocks on its inbox instead of spinning through
empty all-reduces. The front wakes the domain with Wake(n) before it sends work, and tags each
request with the wave it believes is running. A rank that finds work in a wave that already ended
(a request sent before the front learnt of the idle step) asks the front to start the next wave
(Report.start_wave); a Wake that arrives while a rank is still finishing the previous wave is kept
(woken_for) and honoured at the idle step. Commands (END, SHUTDOWN, RESIZE) also go through the sync, so
every rank leaves in the same step; each carries a sequence number so a rank never acts twice on one.

Hooks (RankHooks) are the seams for what runs around the steps; disaggregation's prefill and
decode ranks are this loop with hooks, not copies of it.
"""
from __future__ import annotations

import time

from wideep.parallel.watchdog import RankLostError, raise_if_lost

from .messages import END, RESIZE, SHUTDOWN, Abort, Command, Delta, NewRequest, Report, Wake

COMMAND_WAIT_S = 10.0   # the longest a rank waits for a command's message once the step sync brought it


class RankHooks:
    """Seams around a rank's steps; every default does nothing."""

    def handle(self, msg) -> bool:
        """Any message, before the loop's own handling (a request or abort the hook takes over, or
        a message the loop does not know). -> whether the hook handled it."""
        return False

    def before_schedule(self) -> list[Delta]:
        """Before the scheduler runs (e.g. adopt sequences whose KV arrived). -> deltas to report."""
        return []

    def has_pending(self) -> bool:
        """Work not in the scheduler yet (e.g. KV in flight): keeps the domain's wave running."""
        return False

    def on_layer(self, batch):
        """-> a callback on_layer(i) for this batch's forward (called as layer i's KV is written), or None."""
        return None

    def after_step(self, batch, advanced: list) -> list:
        """After the scheduler applied the step (e.g. release finished prefills, send their trailer).
        -> the sequences whose progress to report to the front (default: those that advanced)."""
        return advanced

    def stats(self) -> dict:
        return {}


class RankLoop:
    """core: this rank's EngineCore; channel: its inbox/report ends; rank: its global rank (in the
    job: the front addresses it so); leader: reports the domain's idle steps (its first rank). stats_interval_s: the longest a busy rank goes without
    reporting its stats; idle_sleep_s: the pause when every rank waits on something (no tokens)."""

    def __init__(self, core, channel, rank: int, leader: bool, hooks: RankHooks | None = None,
                 stats_interval_s: float = 0.5, idle_sleep_s: float = 0.002, poll_s: float = 1.0):
        self.core, self.channel, self.rank, self.leader = core, channel, rank, leader
        self.hooks = hooks or RankHooks()
        self.stats_interval_s, self.idle_sleep_s, self.poll_s = stats_interval_s, idle_sleep_s, poll_s
        self.wave, self.running, self.woken_for = 0, False, -1
        self.command, self.command_seq, self.done_seq = 0, 0, 0     # pending command, its number, last obeyed
        self._members: dict[int, Command] = {}                      # RESIZE commands, by number
        self._deltas: list[Delta] = []
        self._start_wave: int | None = None
        self._generated = 0
        self._last_stats = 0.0
        self.steps = 0
        self.on_step = None          # on_step(seconds): each step that ran, schedule to report (benchmarks)

    @property
    def ctx(self):
        return self.core.ctx   # re-formed after a loss (on_rank_loss = "continue")

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> str:
        """Until a command ends the loop: -> "end" | "shutdown" | "left" (a resize dropped this rank). With
        on_rank_loss = "continue" a lost rank is survived: the ranks re-form and the loop goes on."""
        while True:
            lost = False
            try:
                done = self._iterate()
                if done:
                    return done
            except RankLostError:
                if self.ctx.on_rank_loss != "continue":
                    raise
                lost = True   # recover outside the handler: the exception's frames hold the old groups
            if lost:
                self._recover()

    def _iterate(self) -> str | None:
        blocking = not self.running
        msgs = self.channel.recv(self.poll_s if blocking else 0)
        if blocking and not msgs:
            self._check_lost()
            return None
        for m in msgs:
            self._handle(m)
        return self.step() if self.running else None

    def _recover(self) -> None:
        from .recovery import recover
        stats = recover(self.core)
        self.running = True   # one sync tells whether the survivors have work
        self._report(force=True, recovered=stats)

    def pending(self) -> bool:
        """One process: is there anything for run_once to do?"""
        return self.channel.has_messages() or self.core.has_work() or self.hooks.has_pending()

    def run_once(self) -> None:
        """One process (no lockstep, no waves): handle the inbox, then step if there is work."""
        for m in self.channel.recv(0):
            self._handle(m)
        if self.core.has_work() or self.hooks.has_pending():
            self.step()
        else:
            self._report()

    def step(self) -> str | None:
        """One lockstep iteration (also what a single-process Engine.step runs). -> "end" /
        "shutdown" when a command ended the loop this step, else None."""
        core, sched = self.core, self.core.scheduler
        t_step = time.perf_counter()
        if self.ctx.on_rank_loss == "continue":
            self._check_lost()
        self._deltas += self.hooks.before_schedule()
        if core.compiling:   # structured outputs: requests whose grammar is ready join the scheduler
            self._deltas += [delta_of(s) for s in core.admit_compiled()]
        scheduled_work = sched.has_work()
        has_work = scheduled_work or self.hooks.has_pending() or bool(core.compiling)
        batch = sched.schedule() if scheduled_work else None
        tokens = batch.num_tokens if batch is not None else []
        can_split, vote = core.split_votes(tokens)
        passes, stashed = (core.runner.drafter.wanted(batch, sched.speculator) if core.runner.drafter is not None
                           and has_work else (0, 0))
        sync = core.sync.sync(has_work, can_split, vote, sum(tokens) + stashed, self._command_code(), passes)
        if sync.command:
            return self._obey(sync.command, sync.command_seq)
        if not sync.any_work:
            self._go_idle()
            return None
        plan = sync.plan
        if plan.max_tokens == 0:   # everyone waits on something outside the scheduler (KV transfers)
            time.sleep(self.idle_sleep_s)
            self._report()
            return None
        t0 = time.perf_counter()
        if batch is not None and batch.seqs:
            result = core.runner.execute(batch, plan, on_layer=self.hooks.on_layer(batch))
            extra = sched.spec_extra_tokens
            advanced = sched.apply(batch, result)
            self._deltas += [delta_of(s) for s in self.hooks.after_step(batch, advanced)]
            self._generated += len(result.tokens) - result.tokens.count(None) + sched.spec_extra_tokens - extra
        elif self.ctx.is_single:
            raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
        else:
            core.runner.dummy_step(plan)  # keep the MoE all-to-alls in lockstep
        core.after_step(tokens, plan.split, time.perf_counter() - t0)
        self.steps += 1
        self._report()
        if self.on_step is not None:
            self.on_step(time.perf_counter() - t_step)
        return None

    # -- messages -------------------------------------------------------------------------------------
    def _handle(self, m) -> None:
        if isinstance(m, NewRequest):
            if not self.hooks.handle(m):
                self.core.add_request(m)
            if not self.running:
                self.running = True
                if m.wave < self.wave:   # sent for a wave that ended: the others are idle, get them woken
                    self._start_wave = self.wave
                    self._report(force=True)
        elif isinstance(m, Abort):
            if self.hooks.handle(m):
                return
            seq = self.core.abort(m.request_id)
            if seq is not None:
                self._deltas.append(delta_of(seq))
                self._report(force=not self.running)
        elif isinstance(m, Wake):
            self.woken_for = max(self.woken_for, m.wave)
            if not self.running and m.wave >= self.wave:
                self.running = True
        elif isinstance(m, Command):
            if m.seq > self.done_seq and m.seq > self.command_seq:
                self.command, self.command_seq = m.kind, m.seq
                if m.kind == RESIZE:
                    self._members[m.seq] = m
                self.running = True      # leave through the sync, in step with every other rank
        elif not self.hooks.handle(m):
            raise TypeError(f"rank {self.rank}: unknown control message {m!r}")

    def _command_code(self) -> int:
        return self.command_seq * 4 + self.command if self.command else 0

    def _obey(self, kind: int, seq: int) -> str | None:
        self._receive_command(seq)
        self.done_seq = max(self.done_seq, seq)
        if self.command_seq <= self.done_seq:
            self.command, self.command_seq = 0, 0
        if kind == RESIZE:
            cmd = self._members.pop(seq)
            return self._resize(cmd.members, cmd.tag)
        self.wave += 1                   # a command ends the wave too: every rank leaves here
        self.running = False
        self._report(force=True, idle=True)
        return "shutdown" if kind == SHUTDOWN else "end"

    def _resize(self, members: tuple[int, ...], tag: str) -> str | None:
        """Every rank in the same step (engine/worker/resize.py). A rank left out reports first — its requests'
        tokens so far, flagged as its last report, so the front moves them to the ranks that stay (recompute) —,
        then gives its experts and leaves: -> "left". The others go on stepping in the new shape."""
        from .resize import resize
        if self.ctx.origin_rank not in members:
            self._report(force=True, left=True)
        stats = resize(self.core, list(members), tag)
        if stats is None:
            return "left"
        self.joined(stats)
        return None

    def joined(self, stats: dict) -> None:
        """Every rank of a new shape (a rank that just joined it too): agree on the wave, whose count a new rank
        does not know, and report the resize's part here; one sync then tells whether there is work."""
        self.wave = self.core.sync.agree_max(self.wave)
        self.running = True
        self._report(force=True, resized=stats)

    def _receive_command(self, seq: int) -> None:
        """The step sync can bring command `seq` here before its message (another rank had it first): what the
        front sent this rank before it — an abort of a request that hit a stop string, say — is in the inbox
        ahead of it, so take messages until the command's own has come (bounded: a lost front is the
        watchdog's business)."""
        deadline = time.monotonic() + COMMAND_WAIT_S
        while self.command_seq < seq and time.monotonic() < deadline:
            for m in self.channel.recv(min(self.poll_s, 0.05)):
                self._handle(m)

    def _go_idle(self) -> None:
        self.wave += 1
        self.running = False
        if self.woken_for >= self.wave:      # the front already started the next wave
            self.running = True
        elif self.core.has_work() or self.hooks.has_pending():
            self.running = True              # work that arrived for the wave that just ended
            self._start_wave = self.wave
        self._report(force=True, idle=True)

    # -- reports --------------------------------------------------------------------------------------
    def _report(self, force: bool = False, idle: bool = False, recovered: dict | None = None,
                resized: dict | None = None, left: bool = False) -> None:
        now = time.monotonic()
        stale = now - self._last_stats >= self.stats_interval_s
        if not (self._deltas or force or stale or self._start_wave is not None or self.core.has_kv_events()):
            return
        rep = Report(self.rank, self._deltas, generated=self._generated, start_wave=self._start_wave,
                     idle_wave=self.wave if idle and self.leader else None, recovered=recovered, resized=resized,
                     left=left, kv_events=self.core.take_kv_events())
        if stale or force or self._deltas:
            rep.stats = dict(self.core.stats(), **self.hooks.stats())
            self._last_stats = now
        self._deltas, self._generated, self._start_wave = [], 0, None
        self.channel.report(rep)

    def _check_lost(self) -> None:
        """While blocked on the inbox: a lost rank (the front's included) ends the wait, named."""
        raise_if_lost(self.ctx)


def delta_of(s) -> Delta:
    """A sequence's progress since it was last reported (its first delta carries the prompt logprobs
    and queue time)."""
    n, out = s.num_reported, s.output_token_ids
    s.num_reported = len(out)
    gen = None
    if s.generator is not None and s.params.seed is not None and len(out) > n:
        gen = bytes(s.generator.get_state().numpy())   # SYNC: host state only (a CPU generator)
    lps = s.logprobs[n:] if s.logprobs is not None else None
    if n or not out:   # not the first delta with tokens (every decode step): no first-delta fields
        return Delta(s.request_id, out[n:], lps, s.cumulative_logprob, s.finish_reason,
                     num_preemptions=s.num_preemptions, metrics=s.extra_metrics or None, generator_state=gen)
    return Delta(s.request_id, out[n:], lps, s.cumulative_logprob, s.finish_reason,
                 prompt_logprobs=s.prompt_logprobs,
                 queue_s=(s.first_scheduled_time - s.arrival_time) if s.first_scheduled_time else None,
                 num_preemptions=s.num_preemptions, num_cached_tokens=s.num_cached_tokens,
                 metrics=s.extra_metrics or None, generator_state=gen)


__all__ = ["RankLoop", "RankHooks", "delta_of", "END", "SHUTDOWN"]
