"""Installed distributions' versions (importlib.metadata), for what the service reports about itself
(GetServerInfo, `prefix-service env`) and what a prepared model records (prepare_model.py)."""
from __future__ import annotations

import functools


def dist_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """prefix_service's installed version ("unknown" where it runs from sources not installed)."""
    return dist_version("prefix_service") or "unknown"
