#!/usr/bin/env bash
# Launch an xPyD fleet on one machine: the router plus NUM_PREFILL prefill and
# NUM_DECODE decode `vllm serve` instances with the P2pNcclConnector, each
# registering itself with the router. Ctrl-C (or SIGTERM) stops everything it
# started. Used by run_1p3d.sh and run_3p1d.sh; every setting is an
# environment variable:
#
#   MODEL            model path or name (required)
#   NUM_PREFILL      prefill instances (default 1)
#   NUM_DECODE       decode instances (default 3)
#   HOST             address instances and the router use (default 127.0.0.1)
#   ROUTER_PORT      clients' port (default 10001); DISCOVERY_PORT (default 30001)
#   HTTP_BASE        first instance HTTP port (default 20001; one per instance)
#   KV_BASE          first P2P port (default 21001; 1000 apart per instance)
#   SEND_TYPE        PUT_ASYNC (default), PUT or GET
#   GPUS             "auto" (default): one GPU per instance when nvidia-smi
#                    finds enough, else CPU; "none" forces CPU
#   EXTRA_ARGS       more `vllm serve` arguments for every instance
#   LOG_DIR          where logs go (default ./xpyd-logs)
#   PYTHON           the interpreter with this package installed (default python3)
#   VLLM_DISAGG_ROUTER_TOKEN  the fleet's router token (default: a fresh random
#                    one): registrations and the router's peer grants are
#                    signed with it
#   VLLM_DISAGG_P2P_SECRET    the P2P plane's secret (default: a fresh random
#                    one); required when HOST is not a loopback address
set -euo pipefail

: "${MODEL:?set MODEL to a model path or name}"
NUM_PREFILL="${NUM_PREFILL:-1}"
NUM_DECODE="${NUM_DECODE:-3}"
HOST="${HOST:-127.0.0.1}"
ROUTER_PORT="${ROUTER_PORT:-10001}"
DISCOVERY_PORT="${DISCOVERY_PORT:-30001}"
HTTP_BASE="${HTTP_BASE:-20001}"
KV_BASE="${KV_BASE:-21001}"
SEND_TYPE="${SEND_TYPE:-PUT_ASYNC}"
GPUS="${GPUS:-auto}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
LOG_DIR="${LOG_DIR:-./xpyd-logs}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "${LOG_DIR}"
# Every process started below inherits both (environment, not command line:
# `ps` shows command lines to every user).
export VLLM_DISAGG_ROUTER_TOKEN="${VLLM_DISAGG_ROUTER_TOKEN:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export VLLM_DISAGG_P2P_SECRET="${VLLM_DISAGG_P2P_SECRET:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}"

total=$((NUM_PREFILL + NUM_DECODE))
use_gpus=0
if [[ "${GPUS}" == "auto" ]] && command -v nvidia-smi >/dev/null 2>&1; then
    found=$(nvidia-smi -L 2>/dev/null | wc -l)
    if (( found >= total )); then use_gpus=1; fi
fi

pids=()
cleanup() {
    trap - EXIT INT TERM  # once, whichever fired
    echo "stopping ${#pids[@]} processes"
    for pid in "${pids[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

"${PYTHON:-python3}" "${HERE}/disagg_proxy_p2p_nccl_xpyd.py" --host "${HOST}" --port "${ROUTER_PORT}" \
    --discovery-host "${HOST}" --discovery-port "${DISCOVERY_PORT}" \
    > "${LOG_DIR}/router.log" 2>&1 &
pids+=($!)
echo "router: http://${HOST}:${ROUTER_PORT} (discovery ${DISCOVERY_PORT}), log ${LOG_DIR}/router.log"

start_instance() {  # index role buffer
    local i=$1 role=$2 buffer=$3
    local http_port=$((HTTP_BASE + i)) kv_port=$((KV_BASE + 1000 * i))
    local config
    config=$(printf '{"kv_connector":"P2pNcclConnector","kv_role":"%s","kv_buffer_size":"%s","kv_port":"%s","kv_connector_extra_config":{"kv_ip":"%s","send_type":"%s","proxy_ip":"%s","proxy_port":"%s","http_port":"%s"}}' \
        "${role}" "${buffer}" "${kv_port}" "${HOST}" "${SEND_TYPE}" "${HOST}" "${DISCOVERY_PORT}" "${http_port}")
    local env=()
    if (( use_gpus )); then
        env=(CUDA_VISIBLE_DEVICES="${i}")
    else
        # Several CPU instances share the cores: vLLM's default pins one
        # spinning OpenMP thread per core in every worker, and those teams
        # then wait on each other for seconds. One unpinned thread each.
        env=(VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
             OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}")
    fi
    # shellcheck disable=SC2086  # EXTRA_ARGS is a list of arguments
    env "${env[@]}" vllm serve "${MODEL}" --host "${HOST}" --port "${http_port}" \
        --seed 1024 ${EXTRA_ARGS} --kv-transfer-config "${config}" \
        > "${LOG_DIR}/${role}-${i}.log" 2>&1 &
    pids+=($!)
    echo "${role} ${i}: http://${HOST}:${http_port}, P2P port ${kv_port}, log ${LOG_DIR}/${role}-${i}.log"
}

for ((i = 0; i < NUM_PREFILL; i++)); do start_instance "${i}" kv_producer 1e1; done
for ((i = NUM_PREFILL; i < total; i++)); do start_instance "${i}" kv_consumer 8e9; done

# /metrics, not /instances: the router lists instance addresses to its own
# loopback only, and HOST may be another address of this machine.
echo "waiting for the router to count every instance (GET /metrics) ..."
until [[ $(curl -s "http://${HOST}:${ROUTER_PORT}/metrics" | awk '/^vllm_disagg_router_instances\{/ {s += $2} END {print int(s)}' 2>/dev/null || echo 0) -ge ${total} ]]; do
    sleep 5
done
echo "ready: send OpenAI requests to http://${HOST}:${ROUTER_PORT}/v1/completions (Ctrl-C stops all)"
wait -n "${pids[@]}"
