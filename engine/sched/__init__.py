"""Scheduling, on one DP rank and off the device: Sequence (sequence.py), the paged-block and prefix
accounting of every KV stream the model's spec declares (block_manager.py) and the Scheduler that picks each step's
batch (scheduler.py)."""
