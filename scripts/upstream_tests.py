#!/usr/bin/env python3
"""Upstream vLLM's own tests with vllm_disagg loaded, against the committed
baseline (plugins off): see docs/upstream_tests.md.

    .venv/bin/python scripts/upstream_tests.py                 # the CI set
    .venv/bin/python scripts/upstream_tests.py --set full      # the larger set
    .venv/bin/python scripts/upstream_tests.py --baseline --set ci   # new pin

Everything is in vllm_disagg/testing/upstream.py; it starts vLLM engines, so
on a shared machine run it under ``flock /tmp/vllm-e2e.lock``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_disagg.testing.upstream import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
