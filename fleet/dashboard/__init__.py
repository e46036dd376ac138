"""The operator's dashboard at /ui: static pages shipped in the package, a live SSE feed and a
few actions, mounted on the gateway's app by `mount(app)`."""

from fleet.dashboard.routes import mount

__all__ = ["mount"]
