"""Scheduling, on one DP rank and off the device: Sequence (sequence.py), the paged-block and prefix
accounting (block_manager.py) and the Scheduler that picks each step's batch (scheduler.py)."""
