"""The xPyD proxy of the P2P NCCL design document: the vllm_disagg router.

    python3 disagg_proxy_p2p_nccl_xpyd.py

serves clients on port 10001 and service discovery on port 30001 (what the
instances' ``proxy_port`` names). Every flag of ``vllm-disagg-router --help``
works here too; see docs/router.md.
"""

import sys

from vllm_disagg.router.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
