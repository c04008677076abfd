"""The xPyD router: service discovery, selection policies and the HTTP front end.

registry.py and policy.py import neither quart nor vLLM.
"""

__all__ = [
    "app",
    "circuit_breaker",
    "client_limits",
    "config",
    "discovery",
    "exchange",
    "health",
    "instance",
    "instance_index",
    "legs",
    "metrics",
    "migration",
    "migrator",
    "models_cache",
    "policy",
    "proxy",
    "registry",
    "relay",
    "replies",
    "validation",
]
