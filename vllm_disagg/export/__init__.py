"""Export the patch set as an in-tree vLLM fork (issue 21).

``python -m vllm_disagg.export`` (console script ``vllm-disagg-export``)
generates the fork from the pinned upstream source on the user's machine: the
project cannot carry a copy of vLLM. What is built so far is its first stage,
the input and the pin (:mod:`vllm_disagg.export.source`,
:mod:`vllm_disagg.export.pin`); the command verifies its input and says that
the edit stage is not implemented yet, so nothing pretends to export.
"""
