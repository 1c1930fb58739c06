"""Tests of ckpt.replicator (replicator/): replication, placement, retention and GC."""
