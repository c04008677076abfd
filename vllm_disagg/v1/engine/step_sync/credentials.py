"""Where a DP group's step-sync secret comes from, and the key its frames use.

Only the group's members hold the secret; nothing the DP group's TCP store serves
lets anyone speak for a rank (the store is upstream's and answers anyone who can
connect to it).

* **One launcher** (``vllm serve --data-parallel-size N``, internal LB; ``--headless``
  with every rank on that node; the Ray backend): the process that starts every engine
  core draws a fresh secret at start (:func:`prepare_launch`, run on the config it
  built) and hands it to them in their environment
  (``VLLM_DISAGG_DP_LAUNCH_SECRET``), which only this user (and root) can read. Each
  engine core takes it out of its own environment before it starts its workers
  (:func:`group_secret`). Ray actors get it with the other ``VLLM_*`` variables, in
  the Ray job's runtime environment: whoever can use that Ray cluster runs code in it
  anyway.
* **Ranks started separately** (external LB, ``--data-parallel-rank``; hybrid LB or
  ``--headless`` nodes, ``--data-parallel-start-rank``; one offline ``LLM`` per rank):
  the operator's ``VLLM_DISAGG_DP_SECRET`` (or ``_FILE``), the same on every rank,
  required when the DP master address (``--data-parallel-address``) is beyond
  loopback: refused at start, in one line, without it. On loopback without one,
  the user's local cookie (:mod:`vllm_disagg.wire.cookie`): the same user's
  ranks on this host find the same one, another user cannot read it.

Frames are not authenticated under the secret itself but under a key for one group,
:func:`group_key` (HMAC of a group id under the secret). Rank 0 draws the id per group
and publishes it with the coordinator's address in the store (:mod:`.rendezvous`). It
is no secret; it makes every frame of another group (the same operator secret or
cookie, an earlier run, a recording) fail authentication in this one, so none can be
replayed into it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.v1.engine.step_sync.config import SECRET_BYTES
from vllm_disagg.wire.peers import is_loopback

# What the key derived from the local cookie is for (one key per use).
COOKIE_PURPOSE = "dp-step-sync"
GROUP_ID_BYTES = 16
# Domain of the group key's HMAC.
_GROUP_KEY_LABEL = b"step sync group key|"

FROM_LAUNCHER = "the process that launched every DP rank"


@dataclass(frozen=True)
class GroupSecret:
    value: bytes = field(repr=False)
    # Where it came from, for log lines and errors (never the value).
    source: str


def launched_together(parallel_config) -> bool:
    """Every DP rank of the group is an engine core that this one process starts
    (read the same way in the launcher and in its engine cores)."""
    if (
        parallel_config.data_parallel_backend == "ray"
        and not parallel_config.local_engines_only
    ):
        # CoreEngineActorManager starts an actor for every rank.
        return True
    return parallel_config.data_parallel_size_local == (
        parallel_config.data_parallel_size
    )


def prepare_launch(parallel_config) -> None:
    """In a process about to start engine cores of a step-sync DP group, once it has
    its config: hand a fresh secret to its engine cores when it starts them all, else
    check now (one line) what the separately started ranks will need."""
    if launched_together(parallel_config):
        os.environ[envs.VLLM_DISAGG_DP_LAUNCH_SECRET] = secrets.token_hex(SECRET_BYTES)
        return
    # An inherited one (an ancestor launcher's) must not reach these engine cores.
    os.environ.pop(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, None)
    if parallel_config.data_parallel_size_local:
        separate_secret(parallel_config)


def group_secret(parallel_config) -> GroupSecret:
    """In an engine core: the group's secret (see the module docstring). Removes the
    launcher's from this process's environment, so its workers never inherit it.
    Raises ConfigError (one line) where there is none."""
    handed = envs.dp_launch_secret()
    os.environ.pop(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, None)
    if handed is not None and launched_together(parallel_config):
        try:
            return GroupSecret(bytes.fromhex(handed.decode()), FROM_LAUNCHER)
        except ValueError:
            raise ConfigError(
                f"step sync: {envs.VLLM_DISAGG_DP_LAUNCH_SECRET} is not hex; it is "
                "set by the launching process, never by hand"
            ) from None
    return separate_secret(parallel_config)


def separate_secret(parallel_config) -> GroupSecret:
    """The secret of ranks started separately: the operator's, else (on loopback
    only) the local cookie's."""
    operator = envs.dp_secret()
    if operator is not None:
        source = (
            envs.VLLM_DISAGG_DP_SECRET
            if os.environ.get(envs.VLLM_DISAGG_DP_SECRET)
            else envs.VLLM_DISAGG_DP_SECRET_FILE
        )
        return GroupSecret(operator, source)
    host = parallel_config.data_parallel_master_ip
    if not is_loopback(host):
        raise ConfigError(
            f"step sync: set {envs.VLLM_DISAGG_DP_SECRET} (or "
            f"{envs.VLLM_DISAGG_DP_SECRET_FILE}) to the same secret on every DP "
            f"rank: the ranks are started separately and --data-parallel-address "
            f"{host} is not a loopback address"
        )
    from vllm_disagg.wire.cookie import CookieError, load_cookie

    try:
        cookie = load_cookie()
    except CookieError as e:
        raise ConfigError(
            f"step sync: {e} (or set {envs.VLLM_DISAGG_DP_SECRET} to the same secret "
            "on every DP rank)"
        ) from None
    return GroupSecret(cookie.key(COOKIE_PURPOSE), cookie.describe())


def new_group_id() -> str:
    """A fresh id for one group (rank 0 draws it; public)."""
    return secrets.token_hex(GROUP_ID_BYTES)


def group_key(secret: bytes, group_id: str) -> bytes:
    """The key every frame of the group ``group_id`` is authenticated under."""
    return hmac.new(
        secret, _GROUP_KEY_LABEL + group_id.encode(), hashlib.sha256
    ).digest()
