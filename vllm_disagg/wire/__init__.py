"""The wire layer the router, the P2P connector and their tests share.

Standard library and msgspec only: no vLLM, no torch, no quart. The router
imports this and nothing of the connector; the connector imports this and
nothing of the router.

* :mod:`.peers`: how a request names its prefill and decode peers (the
  request-id and ``kv_transfer_params`` codec) and the ``host:port`` grammar.
* :mod:`.grants`: the router's signature over the peers it names, which
  instances check before they connect anywhere a request says.
* :mod:`.discovery`: registration and heartbeat messages (instance -> router).
* :mod:`.cookie`: this user's local cookie, the credentials of a fleet on
  one host that nobody configured.
"""

__all__ = ["cookie", "discovery", "frames", "grants", "logs", "peers"]
