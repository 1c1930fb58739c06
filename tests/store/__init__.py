"""Tests of ckpt.store (store/): the on-disk format and the storage layer."""
