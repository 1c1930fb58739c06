"""The tests of ckpt; see tests/README.md for the layout."""
