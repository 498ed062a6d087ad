#!/usr/bin/env bash
# The kv-trace replay on the H200 machine (issue 21, item 4: the headline replay), one storage tier per stage:
#   PYTHONPATH=<phoenix installed, e.g. /tmp/phx-site:/tmp/site> OUT=<dir> benchmarks/kvtrace_h200.sh [stages...]
#   stages: smoke disk loop stripe tmpfs plot   (default: all but stripe, in that order)
# Where a command may run 10 minutes at most, run one tier per command (each stage stops itself
# before: PHX_KV_STAGE_TIMEOUT, 540 s; the JSON is written after every point, so what finished is kept):
#   ... kvtrace_h200.sh smoke;  ... disk;  ... loop;  ... tmpfs plot        (~1 + 3 x 9.5 minutes)
# Expects phoenix importable (PYTHONPATH set by the caller, as benchmarks/h200.sh's setup stage
# leaves it), KvikIO and CuPy for the kvikio configuration, torch (else CuPy) for the prefill
# compute; PHX_VENDOR=nvidia. Writes under $OUT: kvtrace-{smoke,disk,loop,stripe,tmpfs}.{json,log},
# kvtrace-{disk,loop,stripe,tmpfs}.png (each tier alone) and kvtrace-tiers.png (the tiers side by side).
#
# Tiers (the SSD tier's slab, read cold: page cache dropped and phoenix's windows released per point):
#   disk:  the local virtio disk (/root, ~2 GB/s)
#   loop:  a loop device over RAM with ext4 (--fast-device auto: sized for the slab; the stand-in
#          for a fast NVMe array; root, and the slab's size free in /dev/shm)
#   stripe: PHX_KV_STRIPES (4) such loop devices, the slab striped over them block by block
#          (--fast-devices: the stand-in for a fast 4-drive array; one loop device's rate is
#          bounded per device, 4 in parallel read ~3x one on the H200 machine; one 10-minute
#          command holds all four configurations at three concurrencies: PHX_KV_STRIPE_CONC=6,8,12
#          PHX_KV_MAX_DURATION=45 PHX_KV_TIME_SCALE=0.05; the record and its figures: benchmarks/README.md)
#   tmpfs: /dev/shm itself: the slab is page cache (RAM-backed, faster than any drive)
# Configurations: dram (evicted KV recomputed), staged (naive pread + synchronous copy), kvikio
# (KvikIO compat mode, 16 threads, 4 MiB tasks, its opportunistic Direct I/O on: what a user picks
# today for a tier larger than RAM; PHX_KV_KVIKIO_DIRECT=off reads through the page cache, which
# here holds the whole slab: a RAM tier the others lack), phoenix (PHX_INFLIGHT 16M on the loop tier).
# phoenix and kvikio write the 8 least recently used DRAM blocks to the SSD tier ahead of their
# eviction (PHX_KV_WRITE_BEHIND, --write-behind; 0: on eviction, in the round, as the records before 5a95950).
#
# Model geometry: Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, fp16: 128 KiB/token),
# blocks of 256 tokens (32 MiB). HBM 6 GiB for KV, DRAM 4 GiB pinned, SSD tier 12 GiB of demoted
# blocks on top of the history (the initial sessions' cached prefixes: ~41 GiB at 48 sessions,
# 28 at 32, 22 at 24, 14 at 16). The slab is history + SSD tier: ~53 GiB for the default grid, on
# /root (the disk stage refuses in one line if /root has less free: then PHX_KV_DISK_CONC=
# 2,4,6,8,12,16,24,32 needs ~40 GiB), in /dev/shm (tmpfs) and as the loop device (~55 GiB).
# Simulated: the trace (seeded, 64 sessions), think times x0.1, token counts x0.25.
#
# Each point runs >= 5 s and until it has 200 TTFT samples (--min-samples), at most
# PHX_KV_MAX_DURATION (40 s; a point stopped there says samples_short), then waits for the rounds
# in progress (at saturation that is one more TTFT; a session still in its round 60 s after the
# stop has every thread's stack and phoenix's counters written to the log); p99 comes with a bootstrap
# 95% CI; a configuration whose p99 CI is wholly over 3 x the 5 s threshold is not run at higher
# concurrencies (--stop-over 3). Points run concurrency-major (all configurations at 2, then 4, ...).
#
# Time per stage ~ sum over points of max(5 s, 200 / QPS, capped at 40 s) + ~1 s of warm-up each,
# plus the history written once (41 GiB: ~20 s on the disk, ~10 s in RAM). From the 2026-12-03
# records: an unloaded session does ~2.9 rounds/s (QPS ~2.9 x sessions), so the 4 configurations at
# 2, 4, 6, 8 sessions take 4 x (35 + 17 + 12 + 9) ~ 300 s on any tier (the disk saturates from 8:
# +80 s). Saturated QPS is ~6 (dram), ~13-16 (staged, phoenix) on the RAM tiers and ~4-6 on the
# disk, so each higher concurrency (12, 16, 24, 32, 48) takes ~33 + 3 x 14 ~ 75 s on loop and tmpfs
# and ~33 + 3 x 40 ~ 150 s on the disk (less where --stop-over skips):
#   loop, tmpfs: ~300 + 5 x 75 - skips ~ 10-11 min;   disk: ~380 + 5 x 150 - skips ~ 13-16 min.
# A stage stops itself at PHX_KV_STAGE_TIMEOUT (540 s: one stage per 10-minute command), which
# cuts the top of the grid evenly for every configuration: expect loop and tmpfs through ~24
# sessions, the disk through ~12-16 (its limits were <= 8 on 2026-12-03). To reach 48 within ~8
# minutes a tier: PHX_KV_TIME_SCALE=0.05 (halves the unsaturated points; twice the load per
# session, so the limits move down the grid), or a longer PHX_KV_STAGE_TIMEOUT where commands
# may run longer.
set -uo pipefail
OUT=${OUT:-/tmp/phx-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
# run from $OUT, not the source tree: `python -m` puts the working directory first on sys.path,
# and the source tree's phoenix/ has no built C core there; phoenix comes from PYTHONPATH
cd "$OUT"
STAGES=${*:-smoke disk loop tmpfs plot}
export PYTHONUNBUFFERED=1 PHX_VENDOR=${PHX_VENDOR:-nvidia}
# the SSD tier is read as from a drive: phoenix's page-cache mapping cache (zero-copy warm
# reads of cached file ranges) is off, or the tmpfs slab would be served as registered windows
export PHX_FMAP_MODE=${PHX_FMAP_MODE:-off}
has() { [[ " $STAGES " == *" $1 "* ]]; }
PY=${PYTHON:-python3}
$PY -c 'import phoenix, phoenix.bench.kvtrace; print("phoenix from", phoenix.__file__)' || { echo "phoenix is not importable: set PYTHONPATH"; exit 2; }

CONC=${PHX_KV_CONC:-2,4,6,8,12,16,24,32,48}
STAGE_TIMEOUT=${PHX_KV_STAGE_TIMEOUT:-540}
COMMON=(--layers 32 --kv-heads 8 --head-dim 128 --q-heads 32 --ffn 14336 --dtype fp16 --block-tokens 256
        --hbm "${PHX_KV_HBM:-6G}" --dram "${PHX_KV_DRAM:-4G}" --ssd "${PHX_KV_SSD:-12G}"
        --sessions 64 --seed 0 --token-scale "${PHX_KV_TOKEN_SCALE:-0.25}" --time-scale "${PHX_KV_TIME_SCALE:-0.1}"
        --warm-start 0.4 --threshold 5 --prefill-chunk 4096
        --configs "${PHX_KV_CONFIGS:-dram,staged,kvikio,phoenix}" --kvikio-threads 16 --kvikio-task 4M
        --kvikio-direct "${PHX_KV_KVIKIO_DIRECT:-on}" --write-behind "${PHX_KV_WRITE_BEHIND:-8}"
        --duration "${PHX_KV_DURATION:-5}" --min-samples "${PHX_KV_MIN_SAMPLES:-200}"
        --max-duration "${PHX_KV_MAX_DURATION:-40}" --stop-over "${PHX_KV_STOP_OVER:-3}")

# one tier: NAME TIMEOUT CONCURRENCY ARGS...; SIGINT at the timeout (the run reports what finished,
# removes its slab and tears a fast device down), SIGKILL 30 s later
tier() {
    local name=$1 limit=$2 conc=$3; shift 3
    local t0; t0=$(date +%s)
    timeout -s INT -k 30 "$limit" $PY -m phoenix.cli.phx bench kv-trace "${COMMON[@]}" --concurrency "$conc" "$@" \
        --json "$OUT/kvtrace-$name.json" --plot "$OUT/kvtrace-$name.png" > "$OUT/kvtrace-$name.log" 2>&1
    echo "$name rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E '^(most concurrent|WARNING|VERIFICATION)' "$OUT/kvtrace-$name.log" | head -20
    tail -3 "$OUT/kvtrace-$name.log"
}

if has smoke; then
    # the same code path with the tiny --dry-run sizes (every configuration that can run, kvikio
    # where importable): fails in seconds if the nvidia path is broken
    t0=$(date +%s)
    timeout 120 $PY -m phoenix.cli.phx bench kv-trace --dry-run --concurrency 1,4 --duration 1 --min-samples 20 \
        --max-duration 20 --slab /root/phx-kv-smoke.slab --json "$OUT/kvtrace-smoke.json" > "$OUT/kvtrace-smoke.log" 2>&1
    rc=$?; echo "smoke rc=$rc ($(( $(date +%s) - t0 )) s)"; tail -12 "$OUT/kvtrace-smoke.log"
    if [ $rc -ne 0 ]; then echo "smoke failed: not running the full replay"; exit $rc; fi
fi

if has disk; then
    tier disk "${PHX_KV_DISK_TIMEOUT:-$STAGE_TIMEOUT}" "${PHX_KV_DISK_CONC:-$CONC}" \
        --slab /root/phx-kvtrace.slab --label "virtio disk (/root, ~2 GB/s)"
    rm -f /root/phx-kvtrace.slab /root/phx-kvtrace.slab.history
fi

if has loop; then
    # the label defaults to the fast device's own: "loop device over RAM (stand-in for a fast NVMe array)"
    # phoenix keeps 16 MiB of device I/O in flight there, as the loaderfast stage: the loop
    # device (one kernel thread copying to tmpfs) slows as bytes in flight grow
    PHX_INFLIGHT=${PHX_KV_LOOP_INFLIGHT:-16M} tier loop "${PHX_KV_LOOP_TIMEOUT:-$STAGE_TIMEOUT}" "${PHX_KV_LOOP_CONC:-$CONC}" \
        --slab /root/phx-kvtrace.slab --fast-device "${PHX_KV_FAST_DEVICE:-auto}"
    losetup -a | grep phx-fastdev && echo "WARNING: a phx-fastdev loop device is left (losetup -d it)"
fi

if has stripe; then
    # phoenix at 16 MiB in flight per device (64M, its default), as on the one-device tier
    PHX_INFLIGHT=${PHX_KV_STRIPE_INFLIGHT:-64M} tier stripe "${PHX_KV_STRIPE_TIMEOUT:-$STAGE_TIMEOUT}" \
        "${PHX_KV_STRIPE_CONC:-$CONC}" --slab /root/phx-kvtrace.slab --fast-device "${PHX_KV_FAST_DEVICE:-auto}" \
        --fast-devices "${PHX_KV_STRIPES:-4}"
    losetup -a | grep phx-fastdev && echo "WARNING: a phx-fastdev loop device is left (losetup -d it)"
fi

if has tmpfs; then
    tier tmpfs "${PHX_KV_TMPFS_TIMEOUT:-$STAGE_TIMEOUT}" "${PHX_KV_TMPFS_CONC:-$CONC}" \
        --slab /dev/shm/phx-kvtrace.slab --label "tmpfs (/dev/shm): the slab is page cache"
    rm -f /dev/shm/phx-kvtrace.slab /dev/shm/phx-kvtrace.slab.history
fi

if has plot; then
    files=()
    for t in disk loop stripe tmpfs; do [ -s "$OUT/kvtrace-$t.json" ] && files+=("$OUT/kvtrace-$t.json"); done
    if [ ${#files[@]} -gt 0 ]; then
        $PY -m phoenix.cli.phx bench kv-trace plot "${files[@]}" --out "$OUT/kvtrace-tiers.png"
        echo "plot rc=$?"
    else
        echo "plot: no kvtrace-{disk,loop,stripe,tmpfs}.json under $OUT"
    fi
fi
