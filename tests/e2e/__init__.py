"""Whole-system tests: real crashes, the crash harness, failing disks, the demo, permissions."""
