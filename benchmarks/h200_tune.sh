#!/usr/bin/env bash
# Follow-up measurements on the H200 after run 3 (phoenix installed by `benchmarks/h200.sh setup`):
# random reads with 64 in flight spread over 8/16/64 workers; the warm first read with the
# io_uring engine (cached pages copied inline by the worker) and with the threads engine;
# phxloader with 8 staging slots and 16 MiB read chunks. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/phx-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PHX_VENDOR=nvidia PYTHONPATH=/tmp/phx-site:/tmp/site PATH=/tmp/phx-site/bin:$PATH
for T in ${PHX_RAND_THREADS:-16 64 8}; do
    timeout 90 phx bench --file /root/phx-bench.bin --size 8G --ops randread --reps 2 --quiet --random-threads "$T" \
        --json "$OUT/rand-$T.json" 2>&1 | grep randread | sed "s/^/workers=$T /"
done
for E in io_uring threads; do
    PHX_IO_ENGINE=$E timeout 120 phx bench --file /dev/shm/phx-bench.bin --size 8G --threads 16 --chunk 16M --ops read \
        --temperature warm --reps 2 --quiet --json "$OUT/warm-$E.json" 2>&1 | grep -E "^read" | sed "s/^/engine=$E /"
done
rm -f /dev/shm/phx-bench.bin
PHX_CHUNK_SIZE=16M timeout 120 python3 -P -m phoenix.phxloader bench /root/phx-model.safetensors --device cuda --make 4G \
    --reps 2 --depth 8 --json "$OUT/loader-d8.json" 2>&1 | tail -9
python3 -c "import json; print('loader staging:', json.load(open('$OUT/loader-d8.json')).get('phxloader_cold', {}))" 2>&1 | cut -c1-400
