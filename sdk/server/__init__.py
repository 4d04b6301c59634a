"""formcast.server: an OpenAI-compatible HTTP server (``formcast serve``).

Needs the ``serve`` extra (``pip install 'formcast[serve]'``: FastAPI and uvicorn).
Names are imported on first use, so that the command line can look at
``formcast.server.command`` without them.
"""

import importlib

_EXPORTS = {"create_app": "formcast.server.app", "BackgroundServer": "formcast.server.launch",
            "serve": "formcast.server.launch"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'formcast.server' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
