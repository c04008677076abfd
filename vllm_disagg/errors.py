"""Errors the patch set raises for bad configuration.

They are subclasses of ``ValueError``/``RuntimeError`` so that library users
catch them as usual, and the ``vllm`` console script wrapper turns any
:class:`VllmDisaggError` into a one-line message and exit status 2 instead of a
traceback.
"""


class VllmDisaggError(Exception):
    """Base class for errors that should reach the user as a plain message."""


class ConfigError(VllmDisaggError, ValueError):
    """Invalid configuration detected at start-up."""


class UnsupportedVllmVersionError(VllmDisaggError, RuntimeError):
    """The installed vLLM is not the version this patch set was written for."""
