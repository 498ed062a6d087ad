#!/usr/bin/env bash
# Does a loop device over RAM scale with devices? (issue 21: the kv-trace `stripe` tier's premise)
#   benchmarks/multiloop.sh      (root; 16 GiB free in /dev/shm; about 15 s)
# Bench side. Four 4 GiB tmpfs files, a loop device with direct I/O over each; dd O_DIRECT reads of
# 1 GiB (1 MiB blocks) from 1 or 4 devices with 1 to 16 readers at once, twice; then 1 GiB written
# to each of the 4 at once, and 4 GiB to one. Prints GB/s (10^9 bytes) of all readers together;
# everything it made is removed at the end.
set -u
N=4; SZ=${PHX_MULTILOOP_MIB:-4096}  # MiB per device (the readers reach 4 GiB into each)
D=$(mktemp -d /dev/shm/phx-multiloop-XXXXXX) || exit 1
devs=()
cleanup() { for d in "${devs[@]}"; do losetup -d "$d"; done; rm -rf "$D"; }
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
for i in $(seq 0 $((N-1))); do dd if=/dev/zero of=$D/$i.img bs=1M count=$SZ status=none & done; wait
for i in $(seq 0 $((N-1))); do
  d=$(losetup --find --show --direct-io=on $D/$i.img) || { echo "losetup failed"; exit 1; }
  devs+=("$d")
done
echo "devices: ${devs[*]}"
run() { # label, then pairs dev:skipMiB
  local label=$1; shift; local t0=$(date +%s.%N)
  for p in "$@"; do dd if=${p%%:*} of=/dev/null bs=1M count=1024 skip=${p##*:} iflag=direct status=none & done; wait
  local t1=$(date +%s.%N); echo "$label: $(python3 -c "print(round($#*1024*1048576/($t1-$t0)/1e9,2))") GB/s ($# readers x 1 GiB)"
}
for rep in 1 2; do
run "1 dev, 1 reader " ${devs[0]}:0
run "1 dev, 4 readers" ${devs[0]}:0 ${devs[0]}:1024 ${devs[0]}:2048 ${devs[0]}:3072
run "2 devs, 2+2     " ${devs[0]}:0 ${devs[0]}:1024 ${devs[1]}:0 ${devs[1]}:1024
run "4 devs, 1 each  " ${devs[0]}:0 ${devs[1]}:0 ${devs[2]}:0 ${devs[3]}:0
run "4 devs, 2 each  " ${devs[0]}:0 ${devs[1]}:0 ${devs[2]}:0 ${devs[3]}:0 ${devs[0]}:2048 ${devs[1]}:2048 ${devs[2]}:2048 ${devs[3]}:2048
run "4 devs, 4 each  " $(for d in ${devs[@]}; do for s in 0 1024 2048 3072; do echo $d:$s; done; done)
done
# writes
t0=$(date +%s.%N); for d in ${devs[@]}; do dd if=$D/0.img of=$d bs=1M count=1024 oflag=direct status=none & done; wait; t1=$(date +%s.%N)
echo "4 devs write 1 each: $(python3 -c "print(round(4*1024*1048576/($t1-$t0)/1e9,2))") GB/s"
t0=$(date +%s.%N); dd if=$D/1.img of=${devs[0]} bs=1M count=4096 oflag=direct status=none; t1=$(date +%s.%N)
echo "1 dev write 1: $(python3 -c "print(round(4096*1048576/($t1-$t0)/1e9,2))") GB/s"
nproc; grep -m1 "model name" /proc/cpuinfo
