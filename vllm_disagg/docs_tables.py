"""Rewrite the docs' option tables from the option rows (run from the
repository's root): ``python -m vllm_disagg.docs_tables``.

One entry per generated table: the P2P connector's ``kv_connector_extra_config``
keys, the router's flags and step sync's ``--additional-config`` keys.
tests/test_docs_tables.py fails while any of them is stale.
"""

from __future__ import annotations

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import (
    extra_config as p2p_config,
)
from vllm_disagg.options.tables import DocTable
from vllm_disagg.router import flags as router_flags
from vllm_disagg.v1.engine.step_sync import config as step_sync_config

DOC_TABLES: dict[str, DocTable] = {
    "docs/p2p_connector.md": p2p_config.DOC_TABLE,
    "docs/router.md": router_flags.DOC_TABLE,
    "docs/step_sync.md": step_sync_config.DOC_TABLE,
}


def main() -> None:
    for path, table in DOC_TABLES.items():
        print(f"{path}: {'updated' if table.update(path) else 'up to date'}")


if __name__ == "__main__":
    main()
