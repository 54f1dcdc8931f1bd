"""A small TCP fault proxy: cut one worker off from PostgreSQL, then heal the cut.

Each worker of the PostgreSQL soak connects to the server through its own
:class:`FaultProxy` (listening on 127.0.0.1, a free port). The proxies share one asyncio
loop in a thread of the test process. While a proxy is *cut*, nothing passes in either
direction: bytes already sent wait inside the proxy, new connections are accepted but not
forwarded — to the worker it looks like a network partition (no reset, no error, just
silence; its heartbeats cannot land). A cut heals in one of two ways:

- ``reset=False``: the partition ends and the held bytes flow again, late (TCP's
  retransmissions succeeding after the network came back);
- ``reset=True``: every connection through the proxy is aborted (a middlebox that dropped
  its state), so the worker sees connection resets and must reconnect.

toxiproxy would do the same, but its Python client is unmaintained (RELIABILITY F8).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any


class ProxyLoop:
    """One event loop in a daemon thread, serving every proxy of a soak run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="soak-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class FaultProxy:
    def __init__(self, loop: ProxyLoop, upstream_host: str, upstream_port: int) -> None:
        self.runner = loop
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.connections = 0  # accepted so far
        self.cuts = 0
        self.refusing = False
        self._open: asyncio.Event | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._server: asyncio.AbstractServer | None = None
        self.runner.call(self._start())

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def is_cut(self) -> bool:
        return self._open is not None and not self._open.is_set()

    # -- faults ------------------------------------------------------------------------------
    def cut(self) -> None:
        """Stop forwarding anything, both ways, on old and new connections."""
        self.cuts += 1
        self.runner.call(self._set(False, reset=False))

    def heal(self, reset: bool) -> None:
        """Forward again; with ``reset`` abort every connection first."""
        self.runner.call(self._set(True, reset=reset))

    def reset(self) -> None:
        """Abort every connection through this proxy (without a cut)."""
        self.runner.call(self._set(True, reset=True))

    def refuse(self, refusing: bool = True) -> None:
        """While refusing, abort every connection, old and new, at once (a server that is
        down: each connection attempt fails fast instead of hanging)."""
        self.refusing = refusing
        if refusing:
            self.reset()

    async def _set(self, open_: bool, reset: bool) -> None:
        assert self._open is not None
        if reset:
            for transport in list(self._transports):
                transport.abort()
            self._transports.clear()
        if open_:
            self._open.set()
        else:
            self._open.clear()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            await self._set(True, reset=True)

        with contextlib.suppress(Exception):
            self.runner.call(stop())

    # -- forwarding ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        self.connections += 1
        if self.refusing:
            writer.transport.abort()
            return
        self._transports.add(writer.transport)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            await self._open.wait()  # a cut holds new connections too
            try:
                up_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the server is down (restarting): the client sees a reset
            self._transports.add(upstream_writer.transport)
            await asyncio.gather(self._pump(reader, upstream_writer), self._pump(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    self._transports.discard(w.transport)
                    w.transport.abort()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        assert self._open is not None
        try:
            while True:
                data = await source.read(65536)
                if not data:
                    break
                if not self._open.is_set():
                    await self._open.wait()
                if sink.transport.is_closing():
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # One side is gone: end the other, so the pair never half-lingers.
            sink.transport.abort()
