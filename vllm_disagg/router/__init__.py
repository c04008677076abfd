"""The xPyD router: service discovery, selection policies and the HTTP front end.

registry.py and policy.py import neither quart nor vLLM.
"""
