#!/usr/bin/env bash
# A mooncake_master and one vLLM server storing to / loading from MooncakeStore
# through KVTailConnector. Hybrid (attention + Mamba) models with prefix
# caching can hit mid-block; that is where stale tails appear.
#   MODEL=Qwen/Qwen3-Next-80B-A3B-Instruct examples/mooncake_store/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?set MODEL to the model to serve}
trap 'kill 0' EXIT INT TERM

mooncake_master -rpc_address=127.0.0.1 -rpc_port=50051 -enable_http_metadata_server=true \
  -http_metadata_server_host=127.0.0.1 -http_metadata_server_port=18080 &
sleep 2
MOONCAKE_CONFIG_PATH="$here/mooncake.json" vllm serve "$MODEL" --port 8000 \
  --enable-prefix-caching --kv-transfer-config "$(cat "$here/kv_transfer_config.json")" &
wait
