"""The xPyD router: service discovery, selection policies and the HTTP front end.

registry.py and policy.py import neither quart nor vLLM.
"""

__all__ = [
    "app",
    "client_limits",
    "config",
    "discovery",
    "metrics",
    "policy",
    "proxy",
    "registry",
    "validation",
]
