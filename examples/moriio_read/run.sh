#!/usr/bin/env bash
# MoRIIO in READ mode (ROCm) behind KVTailConnector: READ destinations are kept
# out of vLLM's new-block zeroing for every group, READ tails are zeroed once
# the READ landed (0.33: after start_load_kv; 0.32: per layer). Needs vLLM
# built for ROCm and amd-mori. vllm-router finds MoRIIO servers by their
# registration (proxy_ip/proxy_ping_port in the JSON files), not by --prefill.
#   MODEL=deepseek-ai/DeepSeek-V4-Flash examples/moriio_read/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?set MODEL to the model to serve}
trap 'kill 0' EXIT INT TERM

vllm-router --vllm-pd-disaggregation --kv-connector moriio \
  --vllm-discovery-address 127.0.0.1:36367 --host 127.0.0.1 --port 8000 &
HIP_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8100 \
  --kv-transfer-config "$(cat "$here/prefill.json")" &
HIP_VISIBLE_DEVICES=1 vllm serve "$MODEL" --port 8200 \
  --kv-transfer-config "$(cat "$here/decode.json")" &
wait
