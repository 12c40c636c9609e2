"""Command-line entry points: ``pagedkv generate | serve | proxy | bench``."""

#: How long ``pagedkv serve`` and ``pagedkv proxy`` keep an idle HTTP/1.1 connection open.
#: Longer than any client's own idle expiry (httpx's, which the proxy and ``bench serve``
#: use, is 5 s; uvicorn's default was 5 s too): with equal timeouts a client reused a
#: connection just as the server closed it, and a request under load failed with a
#: ReadError before a byte of it was answered (about one in 600 at 64 clients).
KEEP_ALIVE_S = 75
