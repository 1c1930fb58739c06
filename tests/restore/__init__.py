"""Tests of ckpt.restore (restore/): resharding, tier fallback, hostile checkpoints, readers."""
