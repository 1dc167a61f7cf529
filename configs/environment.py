"""Process environment phalanx needs before third-party imports read it (Ray reads its
settings when imported): applied by the ``launcher`` and ``spares`` packages on import."""
from __future__ import annotations

import os

# Keep a local Ray on loopback (it otherwise binds the external interface), without token
# auth (2.60 enables it by default) and without usage reporting.
RAY_ENVIRONMENT = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


def apply_ray_environment() -> None:
    """Set each Ray variable unless the user already set it."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
