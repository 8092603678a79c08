"""Integration tests launch real jobs: after each, remove the shared memory killed jobs leave."""

import pytest

from .launch import clean_shm, shm_files


@pytest.fixture(autouse=True)
def _no_leftover_shm():
    before = shm_files()
    yield
    clean_shm(before)
