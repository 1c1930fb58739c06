"""Root conftest: the repository root on sys.path (so `tests.*` and `ckpt` import from this
checkout), and the moto S3 fixtures (`moto_server`, `s3`) of tests/s3_server.py for every test."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest_plugins = ["tests.s3_server"]  # pytest allows pytest_plugins only in the root conftest
