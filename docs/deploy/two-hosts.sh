#!/usr/bin/env bash
# tp-supervise on two plain hosts: one TP group of 2 x 8 ranks, one `supervise serve` per host.
#
#   host A (node 0, hosts the store):  NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./two-hosts.sh
#   host B (node 1):                   NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./two-hosts.sh
#
# MASTER_ADDR is host A's address on the fast network, reachable from host B on ports 29500 (the
# ranks' rendezvous) and 29501 (the supervisors' store). Both hosts run the same command; the
# handshake refuses a group whose command, versions or MODEL_REVISION differ (exit 64), and a
# node missing after --rendezvous-timeout (exit 83). Export the same SUPERVISE_JOIN_TOKEN on both
# hosts to keep strangers out (it is read from the environment: not visible in `ps`).
# docs/deploy.md explains every flag; tests/test_deploy_manifests.py runs this script with a stand-in
# `supervise` and parses what it would run with tp-supervise's own CLI.
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK to 0 on host A and 1 on host B}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of host A}"
export MODEL_REVISION="${MODEL_REVISION:-2024-06-01}"

args=(
  --nnodes 2
  --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR"
  --master-port 29500
  --store-port 29501
  --nproc-per-node 8
  --rendezvous-timeout 600
  --kill-grace 10
  --dump-dir /var/lib/supervise/dumps
  --metrics-addr "${METRICS_ADDR:-127.0.0.1:9180}"
  --fingerprint-env MODEL_REVISION
)
exec supervise serve "${args[@]}" -- python serve.py --model /models/llama
