#!/usr/bin/env bash
# Everything the NVIDIA issue needs from the H200 machine, in one call:
#   benchmarks/h200.sh [stages...]   stages: setup info conformance bench loader lmcache kvtrace split splitfast fastdev loadlatfast loaderfast cpusplit
#   (fastdev, issue 21: the 8 GiB cold bench on a loop device over a tmpfs file, the raw O_DIRECT reference swept;
#   loaderfast, issue 21 item 5: phxloader on that device against safetensors, fastsafetensors and the raw best)
#   (default: all but split and warmcfg; split: benchmarks/h200_diag.py, where random and first warm reads
#   lose time; warmcfg: the staged path's settings against KvikIO on a cached file)
# Builds phoenix there (no network: no build isolation, wheels carried in .whl/),
# runs the conformance suite for `nvidia`, then `phx bench` on the local disk and on
# tmpfs. Everything worth keeping is written under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/phx-out}; mkdir -p "$OUT"
STAGES=${*:-setup info conformance bench loader lmcache kvtrace}
export PYTHONUNBUFFERED=1 PHX_VENDOR=nvidia
SITE=/tmp/phx-site
has() { [[ " $STAGES " == *" $1 "* ]]; }

# setup is skipped when this exact tree is already installed (calls to a warm machine)
STAMP=$(find phoenix vendors templates setup.py pyproject.toml .whl -type f 2>/dev/null | sort | xargs md5sum | md5sum | cut -c1-16)
if has setup && [ "$(cat $SITE/.phx-stamp 2>/dev/null)" = "$STAMP" ]; then
    echo "setup: already installed ($STAMP)"
elif has setup; then
    t0=$(date +%s)
    if ls .whl/*.whl >/dev/null 2>&1; then
        # one at a time: a wheel for another Python is said and left out, not the end of the run
        for w in .whl/*.whl; do
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
                || echo "setup: $(basename "$w") left out (not installable here)"
        done
    fi
    # the build uses the carried setuptools (SPDX license expressions need >= 77)
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . 2>&1 | tail -5 || exit 1
    echo "$STAMP" > "$SITE/.phx-stamp"
    echo "setup: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$SITE:/tmp/site PATH=$SITE/bin:$PATH

if has info; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    df -h / /dev/shm | sed 1d; nproc; uname -r
    for q in /sys/block/*/queue; do [ -e "$q/max_sectors_kb" ] && echo "$q: max_sectors_kb=$(cat $q/max_sectors_kb) max_segments=$(cat $q/max_segments) nr_requests=$(cat $q/nr_requests)"; done
    cat /sys/kernel/mm/transparent_hugepage/enabled
    echo "perf: $(command -v perf || echo none)"
    phx info | tee "$OUT/phx-info.txt"
fi

if has conformance; then
    timeout ${PHX_CONF_TIMEOUT:-150} phx-port test nvidia --report-dir "$OUT" > "$OUT/conformance.log" 2>&1; echo "conformance rc=$?"
    tail -25 "$OUT/conformance.log"
fi

if has diag; then
    # where a caller is held in the stream-ordering test: all thread stacks after 3 s
    timeout 90 phx-port test nvidia -k keeps_order_with_callbacks --report-dir "$OUT/diag" -- -o faulthandler_timeout=3 -s \
        > "$OUT/diag.log" 2>&1; echo "diag rc=$?"; grep -E "passed|failed|Timeout|File .*(phoenix|conformance)" "$OUT/diag.log" | head -40
fi

if has split; then
    timeout ${PHX_SPLIT_TIMEOUT:-150} python3 -P benchmarks/h200_diag.py rand --file /root/phx-bench.bin --size 8G \
        --json "$OUT/diag-rand.json" > "$OUT/diag-rand.log" 2>&1; echo "split rand rc=$?"; cut -c1-200 "$OUT/diag-rand.log" | tail -14
    timeout ${PHX_SPLIT_TIMEOUT:-150} python3 -P benchmarks/h200_diag.py warm --file /dev/shm/phx-bench.bin --size 8G \
        --json "$OUT/diag-warm.json" > "$OUT/diag-warm.log" 2>&1; echo "split warm rc=$?"; cut -c1-230 "$OUT/diag-warm.log" | tail -12
    rm -f /dev/shm/phx-bench.bin
fi

if has splitfast; then
    # issue 21's random-read ceiling: the rand split (raw with its own or shared destinations, phoenix into device
    # memory and into 2 MiB-page host memory, io_uring 8 x 8 / 4 x 16 / 16 x 4, threads engine 64) on the loop device
    timeout ${PHX_SPLIT_TIMEOUT:-200} python3 -P benchmarks/h200_diag.py rand --fast-device ${PHX_FASTDEV_SIZE:-9G} --size 8G \
        --nops ${PHX_SPLIT_NOPS:-40000} --reps ${PHX_SPLIT_REPS:-3} --all --json "$OUT/diag-rand-fastdev.json" > "$OUT/diag-rand-fastdev.log" 2>&1
    echo "splitfast rc=$?"; cut -c1-260 "$OUT/diag-rand-fastdev.log" | grep -v " rep [0-9]:" | tail -16
    if losetup -a | grep -q phx-fastdev || grep -q phx-fastdev /proc/mounts; then echo "splitfast: LEFT BEHIND:"; losetup -a; fi
fi

if has warmcfg; then
    timeout ${PHX_SPLIT_TIMEOUT:-150} python3 -P benchmarks/h200_diag.py warmcfg --file /dev/shm/phx-bench.bin --size 8G \
        --reps ${PHX_SPLIT_REPS:-2} --json "$OUT/diag-warmcfg.json" > "$OUT/diag-warmcfg.log" 2>&1; echo "warmcfg rc=$?"
    cut -c1-200 "$OUT/diag-warmcfg.log" | tail -30
    rm -f /dev/shm/phx-bench.bin
fi

if has bench; then
    DISK=${PHX_BENCH_DIR:-/root}
    SIZE=${PHX_BENCH_SIZE:-8G}
    timeout ${PHX_COLD_TIMEOUT:-200} phx bench --file "$DISK/phx-bench.bin" --size "$SIZE" --threads ${PHX_BENCH_THREADS:-16} --chunk 16M \
        --ops read,write,randread --random-ops ${PHX_RANDOM_OPS:-60000} --temperature cold --reps ${PHX_BENCH_REPS:-2} --quiet \
        --json "$OUT/bench-disk.json" --plot "$OUT/bench-disk.png"
    timeout ${PHX_WARM_TIMEOUT:-100} phx bench --file /dev/shm/phx-bench.bin --size "$SIZE" --threads ${PHX_BENCH_WARM_THREADS:-16} --chunk 16M \
        --ops read --temperature warm --reps 3 --quiet --json "$OUT/bench-warm.json" --plot "$OUT/bench-warm.png"
    rm -f /dev/shm/phx-bench.bin
fi

if has cpusplit; then
    # issue 21: where phoenix's CPU goes per chunk on the loop device over RAM: cold reads and writes of a 4 GiB file
    # at several workers:queue depth:chunk points, CPU split per thread (caller, phx-io workers, the runtime's threads)
    # (PHX_SPLIT_FIXED=on,off / PHX_SPLIT_COMPLETION=auto,callback: each point with registered buffers or not, with
    # polled events or host callbacks, alternating; PHX_SPLIT_RANDOM= (set, empty): no random reads)
    timeout ${PHX_SPLIT_TIMEOUT:-150} python3 -P benchmarks/cpu_split.py --fast-device 5G --size 4G \
        --reps ${PHX_SPLIT_REPS:-1} ${PHX_SPLIT_POINTS:+--points $PHX_SPLIT_POINTS} --random "${PHX_SPLIT_RANDOM-64K:8:8}" \
        --fixed-buffers ${PHX_SPLIT_FIXED:-on} --copy-completion ${PHX_SPLIT_COMPLETION:-auto} --json "$OUT/cpu-split.json" \
        > "$OUT/cpu-split.log" 2>&1
    echo "cpusplit rc=$?"; cut -c1-300 "$OUT/cpu-split.log" | tail -40
fi

if has fastdev; then
    # issue 21: "loop device over RAM (stand-in for a fast NVMe array)": a 9 GiB tmpfs file in /dev/shm, losetup
    # --direct-io=on, ext4, torn down by phx bench itself (also on timeout's SIGTERM). Raw O_DIRECT is swept over
    # threads 1,4,8,16,32 x chunks 1M,4M,16M (random reads: 8..128 in flight), phoenix over workers x queue depth x
    # chunk (phoenix/bench/sweep.py PHOENIX_GRID, 2-32 MiB in flight, and its defaults); each side's pick is
    # re-measured in 3 interleaved repetitions with naive and KvikIO (at phoenix's chunks in flight); every ratio
    # divides by raw's re-measured best. Random reads of 4 KiB, 64 KiB and 1 MiB at 64 in flight, KvikIO beside.
    losetup -a; df -h /dev/shm | sed 1d
    timeout ${PHX_FASTDEV_TIMEOUT:-420} phx bench --fast-device ${PHX_FASTDEV_SIZE:-9G} --size ${PHX_BENCH_SIZE:-8G} \
        --threads ${PHX_BENCH_THREADS:-16} --chunk 16M --ops ${PHX_FASTDEV_OPS:-read,write,randread} --random-bs ${PHX_RANDOM_BS:-4K,64K,1M} \
        --random-ops ${PHX_RANDOM_OPS:-60000} ${PHX_RANDOM_THREADS:+--random-threads $PHX_RANDOM_THREADS} --temperature cold --reps ${PHX_BENCH_REPS:-3} --quiet \
        --json "$OUT/bench-fastdev.json" --plot "$OUT/bench-fastdev.png" > "$OUT/bench-fastdev.log" 2>&1
    echo "fastdev rc=$?"; cut -c1-220 "$OUT/bench-fastdev.log" | head -30
    if losetup -a | grep -q phx-fastdev || grep -q phx-fastdev /proc/mounts; then echo "fastdev: LEFT BEHIND:"; losetup -a; fi
fi

if has loadlatfast; then
    # issue 21 item 3 on the loop device over RAM: p50/p99 of 32 MiB block loads (200 per phase) idle, with an 8 GiB
    # write stream at priority=background, the same stream at normal priority, and KvikIO with its own writes
    timeout ${PHX_LOADLAT_TIMEOUT:-240} phx bench loadlat --fast-device ${PHX_LOADLAT_DEVICE:-13G} --size 4G --block 32M \
        --write-size 8G --threads ${PHX_LOADLAT_THREADS:-8} --quiet --json "$OUT/loadlat-fastdev.json" \
        > "$OUT/loadlat-fastdev.log" 2>&1
    echo "loadlatfast rc=$?"; cut -c1-220 "$OUT/loadlat-fastdev.log" | tail -12
    if losetup -a | grep -q phx-fastdev || grep -q phx-fastdev /proc/mounts; then echo "loadlatfast: LEFT BEHIND:"; losetup -a; fi
fi

if has loader; then
    # PHX_LOADER_CHUNKS: phoenix chunk sizes to run it with ("default": the settings' own)
    for C in ${PHX_LOADER_CHUNKS:-default}; do
        [ "$C" = default ] && unset PHX_CHUNK_SIZE || export PHX_CHUNK_SIZE=$C
        echo "phxloader, PHX_CHUNK_SIZE=${PHX_CHUNK_SIZE:-default}"
        timeout ${PHX_LOADER_TIMEOUT:-90} phx bench loader /root/phx-model.safetensors --device cuda \
            --make ${PHX_LOADER_SIZE:-4G} --reps ${PHX_LOADER_REPS:-2} --json "$OUT/loader-$C.json" 2>&1 | tail -15
    done
    unset PHX_CHUNK_SIZE
fi

if has loaderfast; then
    # issue 21 item 5: an 8 GiB multi-dtype safetensors file written onto a "loop device over RAM (stand-in for a fast
    # NVMe array)" (9 GiB tmpfs file, losetup --direct-io=on, ext4; torn down by phx bench itself, also on timeout's
    # SIGTERM); raw O_DIRECT swept over threads 4,8,16,32 x chunks 1M,4M,16M (+ phoenix's own) and phxloader over
    # workers x bytes in flight (+ the settings' own), their bests re-measured interleaved with safetensors and
    # fastsafetensors (wheel in .whl/), cold and warm.
    # Done when: phxloader cold >= 0.90x the raw best and faster than safetensors cold (the log's "issue 21 target").
    losetup -a; df -h /dev/shm | sed 1d
    # PHX_INFLIGHT 16M (16 workers x 1 MiB chunks): the settings' own point of phxloader's sweep
    PHX_INFLIGHT=${PHX_INFLIGHT:-16M} timeout ${PHX_LOADERFAST_TIMEOUT:-420} phx bench loader --fast-device ${PHX_LOADERFAST_DEVICE:-9G} \
        --make ${PHX_LOADERFAST_SIZE:-8G} --device cuda --reps ${PHX_LOADERFAST_REPS:-3} \
        --json "$OUT/loader-fastdev.json" > "$OUT/loader-fastdev.log" 2>&1
    echo "loaderfast rc=$?"; grep -v "^raw sweep [0-9]\|^phxloader sweep [0-9]" "$OUT/loader-fastdev.log" | cut -c1-400 | tail -24
    if losetup -a | grep -q phx-fastdev || grep -q phx-fastdev /proc/mounts; then echo "loaderfast: LEFT BEHIND:"; losetup -a; fi
fi

if has lmcache; then
    # LMCache 0.5.6's own `phx` GDS backend against libphxfile (wheel carried in .whl/)
    timeout ${PHX_LMCACHE_TIMEOUT:-240} python3 benchmarks/lmcache_phx.py --dir /root --size ${PHX_LMCACHE_SIZE:-4G} \
        --chunk 256M --reps 2 --json "$OUT/lmcache-phx.json" > "$OUT/lmcache-phx.log" 2>&1
    echo "lmcache rc=$?"; tail -30 "$OUT/lmcache-phx.log"
fi

if has kvtrace; then
    OUT="$OUT" bash benchmarks/kvtrace_h200.sh ${PHX_KV_STAGES:-}
fi
