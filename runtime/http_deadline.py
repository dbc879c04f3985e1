"""uvicorn's HTTP protocol with a deadline for each request's head.

uvicorn (0.54) closes a connection that idles between requests (`timeout_keep_alive`), but that
timer restarts with every byte received and does not run before a connection's first request,
so a client that connects and sends nothing, or trickles a request head a byte at a time, holds
its connection and file descriptor for as long as it likes (slowloris): a few hundred such
clients exhaust the server's descriptors. ASGI middleware cannot help, since it runs only once
a head is complete. `request_deadline_protocol(seconds)` returns uvicorn's own protocol class
(httptools when installed, else h11) with one addition: from the moment a connection opens, and
again after each response, its next request head must be complete within `seconds`, or the
connection is closed. A request being read or answered is never cut (its body has its own
deadline in `server._read_json`; a long stream is fine).

    uvicorn.run(app, host="127.0.0.1", port=8000, http=request_deadline_protocol(30))
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("specedge.serve")

__all__ = ["request_deadline_protocol"]


def request_deadline_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class that closes a connection whose next request head is not
    complete `seconds` after the connection opened or its previous response ended.

    Relies on what uvicorn's h11 and httptools protocols share: `connection_made`,
    `on_response_complete`, `connection_lost`, `timeout_keep_alive_handler` (the close it
    does for an idle connection), `loop`, `transport` and `cycle` (the request in progress,
    None before the first). `tests/test_serve.py` checks it on a real server.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class RequestDeadline(base):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            cycle = self.cycle
            waiting = cycle is None or cycle.response_complete  # no request head since arming
            if waiting and not self.transport.is_closing():
                log.info("closed a connection that sent no complete request head within %g s",
                         seconds)
                self.timeout_keep_alive_handler()

    RequestDeadline.__name__ = RequestDeadline.__qualname__ = f"RequestDeadline{base.__name__}"
    return RequestDeadline
