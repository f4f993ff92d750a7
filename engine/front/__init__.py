"""The front and the public API: Engine (engine.py), LLM, AsyncEngine; Front (front.py: request intake,
assignment to DP ranks, re-admission) and the per-request output state (outputs.py)."""
