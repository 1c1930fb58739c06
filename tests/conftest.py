"""Root conftest: the repository root on sys.path (so `tests.*` and `ckpt` import from this
checkout), the moto S3 fixtures (`moto_server`, `s3`) of tests/s3_server.py and the tmpfs directory
(`shm_root`) of tests/shm_root.py for every test."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest_plugins = ["tests.s3_server", "tests.shm_root"]  # pytest allows pytest_plugins only in the root conftest
