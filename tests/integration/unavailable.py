"""A cluster a test needs cannot be built here: skip it, or fail it under CI=true (CI has root)."""

import os

import pytest


def skip_or_fail(what: str, error) -> None:
    """Skip with `what` and the reason; under CI=true, where it must work, fail instead."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true but {what} cannot be had here: {error}")
    pytest.skip(f"{what} cannot be had here: {error}")
