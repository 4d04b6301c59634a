"""Running the application: in the foreground (``formcast serve``) or on a thread.

:class:`BackgroundServer` runs uvicorn on a free port of this machine in a
background thread, for tests, notebooks and benchmarks that want a real HTTP
server in their own process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from formcast.async_llm import AsyncLLM

log = logging.getLogger("formcast.server")


def serve(llm: AsyncLLM, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info") -> None:
    """Serve ``llm`` until interrupted (blocks), then stop its engine loop.

    Parameters
    ----------
    llm : formcast.AsyncLLM
    model_name : str
        The ``model`` clients ask for.
    host, port : str, int
        Where to listen.
    api_key : str | None
        Required as a bearer token on ``/v1`` routes when given.
    log_level : str
        uvicorn's log level ("debug", "info", "warning", ...).
    """
    import uvicorn

    from formcast.server.app import create_app

    app = create_app(llm, model_name=model_name, api_key=api_key)
    committed = commit_kv_cache(llm.llm.engine)
    if committed:
        log.info("KV cache resident: %d MB", committed >> 20)
    log.info("serving %s on http://%s:%d/v1", model_name, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        llm.loop.close()


def commit_kv_cache(engine: Any) -> int:
    """Write every page of a CPU engine's KV cache once, so that all of it is resident now.

    On the CPU the cache is allocated zeroed by the kernel and becomes resident
    block by block as requests first write it; the block pool hands out the least
    recently freed block first (to keep cached prefixes), so under load a server's
    memory would climb until every block had been used once. Committed at start,
    the server holds its steady-state memory from its first request: resident
    memory stays flat under load, and a machine too small for the cache fails at
    start rather than mid-load. (Changes no state but residency: the cache is
    still all zeros.)

    Parameters
    ----------
    engine : formcast.engine.Engine

    Returns
    -------
    int
        Bytes committed (0 on CUDA, for a model without a paged cache, or for a
        multi-process engine).
    """
    # (a model without a paged cache, or ranks in other processes: nothing here to commit)
    runner = getattr(engine, "runner", None)
    caches = [t for t in getattr(runner, "kv_caches", ()) if t.device.type == "cpu"]
    for cache in caches:
        cache.zero_()
    return sum(t.numel() * t.element_size() for t in caches)


class BackgroundServer:
    """The OpenAI-compatible server on a background thread, on a free local port.

    Parameters
    ----------
    llm : formcast.AsyncLLM
    model_name : str
    api_key : str | None

    Examples
    --------
    >>> with BackgroundServer(allm, model_name="smollm2") as server:   # doctest: +SKIP
    ...     client = openai.OpenAI(base_url=server.url, api_key="none")
    """

    def __init__(self, llm: AsyncLLM, *, model_name: str, api_key: str | None = None,
                 log_level: str = "warning") -> None:
        import uvicorn

        from formcast.server.app import create_app

        self.app = create_app(llm, model_name=model_name, api_key=api_key)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level,
                                                     timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL clients take (``.../v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        """Start serving; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="formcast-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving (the engine loop stays: its owner closes it)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
