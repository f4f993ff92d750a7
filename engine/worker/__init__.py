"""The per-rank worker: EngineCore (core.py: one rank's parts), the step loop (rank_loop.py), ModelRunner
and sampler, the per-step DP sync (step_sync.py), the control channel and its messages, and the
rank-side recovery after a lost rank (recovery.py)."""
