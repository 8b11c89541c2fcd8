"""Drafter training: the target's own continuations as data (data.py), the loop (train.py), checkpoints (state.py)."""
