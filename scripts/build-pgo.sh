#!/usr/bin/env bash
# headroom built with profile-guided optimisation (PGO): an instrumented build serves a training
# workload from the repository (simulated replicas, no GPU), and the counts it records decide the
# final build's layout (hot code together, cold code out of the way) and its inlining. What
# headroom spends per relayed chunk in user space beyond nginx is mostly instruction-cache misses
# (docs/benchmarks.md, "side by side under callgrind"), which such a layout cuts: 60% fewer under
# callgrind, 6% less CPU per chunk on the machine ("a build trained on the contract's traffic").
#
#   scripts/build-pgo.sh                 # -> target/pgo/headroom (release-lto, trained 20 s)
#   PROFILE=release scripts/build-pgo.sh # on the quicker profile
#   TRAIN_S=60 scripts/build-pgo.sh      # a longer training run
#
# Training, with the instrumented `headroom serve` in front of the simulator (`headroom sim` and
# `headroom replay` from the ordinary release build):
#   1. the overhead contract's streams: one fixed-clock replica, 64-token prompts, 100-token
#      streams, RATE (200) requests/s for TRAIN_S seconds, measurement and capture on;
#   2. routing: a shortened `headroom demo` (chat turns beside a batch job over four replicas,
#      round-robin and headroom's pools, admission and prefix routing), in the instrumented build.
# Needs rustup's llvm-tools (llvm-profdata matching rustc's LLVM), installed when missing. The
# instrumented and final builds use target directories of their own (target/pgo/), so the
# ordinary builds are left as they are; each is a full build (the whole script about 20 minutes
# for release-lto on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release-lto}
TRAIN_S=${TRAIN_S:-20}
RATE=${RATE:-200}
OUT=target/pgo
host=$(rustc -vV | sed -n 's/^host: //p')
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
if [ ! -x "$profdata" ] && command -v rustup >/dev/null; then
  echo "installing llvm-tools (llvm-profdata) with rustup" >&2
  rustup component add llvm-tools >&2 || true
fi
[ -x "$profdata" ] || {
  echo "no llvm-profdata at $profdata: it comes with rustup's llvm-tools component (rustup component add llvm-tools); a Rust without rustup needs an llvm-profdata of rustc's LLVM version ($(rustc -vV | sed -n 's/^LLVM version: //p'))" >&2
  exit 1
}

# sources_digest: one digest of the workspace's Rust sources and manifests. Counts fit only the code
# they were taken from: a function changed between the instrumented build and the final one loses
# its counts (rustc warns of a hash mismatch and optimises it untrained).
sources_digest() {
  find . \( -path ./target -o -path ./results -o -path ./.git -o -path "./$OUT" \) -prune -o -type f \
    \( -name '*.rs' -o -name Cargo.toml -o -name Cargo.lock \) -print | LC_ALL=C sort | xargs sha256sum | sha256sum
}
sources=$(sources_digest)

data=$(realpath -m "$OUT/data")
rm -rf "$data" "$OUT/train"
mkdir -p "$data" "$OUT/train"
echo "1/5 instrumented build ($PROFILE)" >&2
# With --target, RUSTFLAGS reach the program only, not build scripts or proc macros.
RUSTFLAGS="-Cprofile-generate=$data" cargo build --profile "$PROFILE" --locked -q --bin headroom \
  --target "$host" --target-dir "$OUT/gen"
gen="$OUT/gen/$host/$PROFILE/headroom"

echo "2/5 the ordinary release build (the simulator and the load generator of the training)" >&2
cargo build --release --locked -q --bin headroom
bin=target/release/headroom
# The benchmarks' placement and priority settings are not this script's: everything runs unpinned.
PIN=0 ISOLATE=0 NOIDLE=0 LOAD_NICE=
source scripts/bench-common.sh
train="$OUT/train"

# serve_through CONFIG NAME: the instrumented proxy on ephemeral ports with CONFIG; sets proxy_url
# and proxy_pid.
serve_through() {
  "$gen" serve --config "$1" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --capture "$train/$2.capture.jsonl" >"$train/$2.url" 2>"$train/$2.log" &
  proxy_pid=$!
  pids+=($proxy_pid)
  wait_line "$train/$2.url" http
  proxy_url=$(grep -m1 http "$train/$2.url")
}

# stop PID: SIGINT and wait: the instrumented build writes its counts as it exits.
stop() {
  kill -INT "$1"
  wait "$1" || { echo "the instrumented proxy did not exit cleanly: $train/*.log" >&2; exit 1; }
}

echo "3/5 training: streams, ${RATE} req/s for ${TRAIN_S} s" >&2
stream_trace "$train/streams.jsonl" $((RATE * TRAIN_S)) 100
start_stream_replica fixed 20 10 "$train"
printf '[shutdown]\ndrain_ms = 0\n\n[[backends]]\nurl = "%s"\n' "$replica_url" >"$train/streams.toml"
serve_through "$train/streams.toml" streams
"$bin" replay --trace "$train/streams.jsonl" --rate "$RATE" --target "$proxy_url" --seed 7 \
  --out "$train/streams-replay" >"$train/streams-replay.txt" 2>"$train/streams-replay.log"
stop "$proxy_pid"
kill -INT "$replica_pid"
wait "$replica_pid" || true

echo "3/5 training: routing, a shortened demo in the instrumented build" >&2
# The demo runs its replicas, proxies and load in one process: chat turns of four tenants beside a
# batch job, through round-robin and through headroom's pools, admission and prefix routing.
"$gen" demo --requests 60 --batch-requests 90 --out "$train/demo" >"$train/demo.txt" 2>"$train/demo.log"

echo "4/5 merging the counts" >&2
"$profdata" merge -o "$OUT/merged.profdata" "$data"
# Cargo does not track the file -Cprofile-use reads: named by its content, new counts are a new
# flag, and so a rebuild.
sum=$(sha256sum "$OUT/merged.profdata" | cut -c1-16)
rm -f "$OUT"/headroom-*.profdata
mv "$OUT/merged.profdata" "$OUT/headroom-$sum.profdata"

echo "5/5 optimised build ($PROFILE, with the counts)" >&2
RUSTFLAGS="-Cprofile-use=$(realpath "$OUT/headroom-$sum.profdata")" cargo build --profile "$PROFILE" \
  --locked -q --bin headroom --target "$host" --target-dir "$OUT/use"
if [ "$(sources_digest)" != "$sources" ]; then
  echo "the sources changed while the build was trained: its counts do not fit them; run again (nothing copied to $OUT/headroom)" >&2
  exit 1
fi
cp "$OUT/use/$host/$PROFILE/headroom" "$OUT/headroom"
echo "$OUT/headroom" >&2
