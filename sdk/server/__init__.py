"""formcast.server: an OpenAI-compatible HTTP server (``formcast serve``).

Needs the ``serve`` extra (``pip install 'formcast[serve]'``: FastAPI and uvicorn).
"""

from formcast.server.app import create_app
from formcast.server.launch import BackgroundServer, serve

__all__ = ["BackgroundServer", "create_app", "serve"]
