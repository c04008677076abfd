"""KVTransferConfig takes P2pNcclConnector's documented JSON.

Its options given at the top level (as the connector's documentation shows
them) are moved into kv_connector_extra_config; other connectors' configs
are left to the usual validation.
"""

import pytest

from vllm.config.kv_transfer import KVTransferConfig

pytestmark = pytest.mark.cpu_test


def test_top_level_options_move_into_the_extra_config():
    config = KVTransferConfig(
        kv_connector="P2pNcclConnector",
        kv_role="kv_producer",
        kv_buffer_size="1e9",
        kv_port="21001",
        kv_connector_extra_config={"http_port": "8100"},
    )
    extra = config.kv_connector_extra_config
    assert extra["kv_buffer_size"] == "1e9"
    assert config.kv_port == 21001  # a field of its own, made an int
    assert extra["http_port"] == "8100"


def test_other_connectors_still_refuse_unknown_keys():
    with pytest.raises(Exception, match="kv_buffer_size"):
        KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_size="1e9"
        )
