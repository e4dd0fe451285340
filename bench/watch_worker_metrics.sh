#!/bin/bash
# Scrapes a running nxdi-bench configuration's decode and prefill workers every 5 s (their
# metrics addresses from the NXDI_READY lines of the runner's log, once they appear) and
# appends "unix_time D|P metric value" lines to OUT: the decode worker's step timers, counters
# and gauges, the prefill worker's queue and counters. Stops when the decode worker is gone.
#
#   bench/watch_worker_metrics.sh results/goodput/<run>/logs/disaggregated.log /tmp/metrics.txt &
#   .venv/bin/nxdi-bench compare ... --out-dir results/goodput/<run>
LOG=$1; OUT=$2
addr() {
  grep -o "\"role\": \"$1\", \"grpc\": \"[0-9.:]*\", \"metrics\": \"[0-9.:]*\"" "$LOG" 2>/dev/null \
    | tail -1 | grep -o 'metrics": "[0-9.:]*' | cut -d'"' -f3
}
decode=""; prefill=""
while [ -z "$decode" ] || [ -z "$prefill" ]; do sleep 2; decode=$(addr decode); prefill=$(addr prefill); done
echo "decode $decode prefill $prefill" > "$OUT"
while true; do
  now=$(date +%s)
  d=$(curl -s -m 2 "http://$decode/metrics") || break
  [ -z "$d" ] && break
  p=$(curl -s -m 2 "http://$prefill/metrics")
  echo "$d" | grep -E "^nxdi_(decode_step_duration_seconds|token_generation_forward_seconds)_(sum|count)|^nxdi_(decode_steps|generated_tokens|local_prefills|prompt_tokens|kv_transfer_bytes|preemptions)_total|^nxdi_(running_sequences|queue_depth_requests|kv_blocks_used_blocks|open_kv_transfers|queued_prompt_tokens|prefill_tokens_per_second)" \
    | sed "s/^/$now D /" >> "$OUT"
  echo "$p" | grep -E "^nxdi_(prompt_tokens|requests)_total|^nxdi_(queue_depth_requests|open_kv_transfers|queued_prompt_tokens|prefill_tokens_per_second)" \
    | sed "s/^/$now P /" >> "$OUT"
  sleep 5
done
