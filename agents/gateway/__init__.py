"""The pdbridge gateway: an OpenAI-compatible router in front of the prefill and decode pools.

Modules: ``decision`` (pure routing rules), ``breaker`` (circuit breakers), ``budget``
(fallback token bucket), ``tuning`` (short-term threshold re-tuning), ``config`` (the
deployment snapshot and the gateway's own knobs), ``state`` (per-site live view), ``poller``
(console polling with a last-good copy on disk), ``proxy`` (upstream legs, pass-through
streaming), ``app`` (the aiohttp server), ``cli`` (``pdbridge gateway``).
Never imports Django.
"""
