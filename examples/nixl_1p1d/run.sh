#!/usr/bin/env bash
# 1 prefill + 1 decode vLLM server on one GPU host (GPU 0 and GPU 1), NIXL
# behind KVTailConnector, and vllm-router (pip install vllm-router) in front.
#   MODEL=Qwen/Qwen3-Next-80B-A3B-Instruct examples/nixl_1p1d/run.sh
# NIXL moves a Mamba/linear-attention hybrid's conv state only in the DS layout,
# which vLLM picks by itself on CPU only: set it for both servers (models without
# such layers ignore it).
set -euo pipefail
export VLLM_SSM_CONV_STATE_LAYOUT=${VLLM_SSM_CONV_STATE_LAYOUT:-DS}
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?set MODEL to the model to serve}
trap 'kill 0' EXIT INT TERM

CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 \
  vllm serve "$MODEL" --port 8100 --kv-transfer-config "$(cat "$here/prefill.json")" &
CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5700 \
  vllm serve "$MODEL" --port 8200 --kv-transfer-config "$(cat "$here/decode.json")" &
# Waits (up to --worker-startup-timeout-secs) until both servers answer /health.
vllm-router --vllm-pd-disaggregation --kv-connector nixl \
  --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
  --host 127.0.0.1 --port 8000 --worker-startup-timeout-secs 1800 &
wait
