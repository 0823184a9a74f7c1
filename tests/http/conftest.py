"""The data-plane fixtures (tests/data_plane.py), the token scan included, for this folder."""

from data_plane import (  # noqa: F401 (fixtures, found by name)
    clients,
    replica,
    replica_factory,
    router_settings,
    tls_replica,
    token_never_leaks,
)
