"""`SSHTunnelInstrumentor`: SSH tunnel spans and metrics for dstack's `SSHTunnel` (see `tunnels`, which
holds the instrumentation, `instrument_tunnel` for a tunnel class of one's own and the other names
this module passes on; `setup()` installs it through `tunnels.INSTALLATION`, without this module)."""

from __future__ import annotations

from collections.abc import Collection

from ._instrumentor import InstallationInstrumentor
from .tunnels import (
    COMPONENT,
    DSTACK_TUNNEL_MODULE,
    INSTALLATION,
    MAX_HOST_CHARS,
    SETTING,
    Describe,
    describe_dstack,
    describe_generic,
    instrument_tunnel,
    uninstrument_tunnel,
)


class SSHTunnelInstrumentor(InstallationInstrumentor, installation=INSTALLATION):
    """`ssh.tunnel.*` spans and metrics for dstack's `SSHTunnel`, wrapped when its module is imported
    (now, if it is); `uninstrument()` unwraps it.

    Keyword arguments of `instrument()`: `meter_provider` (default: the global one).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("dstack >= 0.22, < 0.23",)


__all__ = [
    "COMPONENT",
    "DSTACK_TUNNEL_MODULE",
    "INSTALLATION",
    "MAX_HOST_CHARS",
    "SETTING",
    "Describe",
    "SSHTunnelInstrumentor",
    "describe_dstack",
    "describe_generic",
    "instrument_tunnel",
    "uninstrument_tunnel",
]
