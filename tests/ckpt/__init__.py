"""Tests of the ckpt package itself (ckpt/): the Checkpointer, its save pipeline, the CLI, packaging."""
