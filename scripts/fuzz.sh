#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each with libFuzzer (cargo-fuzz, nightly
# toolchain), from the hand-written seeds in fuzz/seeds/TARGET and the corpus grown by earlier runs
# (fuzz/corpus.tar.gz, unpacked into fuzz/corpus/TARGET, which grows and is not committed; after a
# run, `cargo fuzz cmin` and re-pack it to keep what was learnt). Each target's last lines go to results/fuzz/TARGET.log; a crash stops the script
# with the input that caused it in fuzz/artifacts/TARGET.
#
#   SECONDS_EACH=600 scripts/fuzz.sh                 # the recorded run (docs/reliability.md)
#   TARGETS="sse" SECONDS_EACH=60 scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${SECONDS_EACH:-600}
TARGETS=${TARGETS:-sse inspect trace kv_events}
OUT=${OUT:-results/fuzz}
command -v cargo-fuzz >/dev/null || { echo "needs cargo-fuzz: cargo install cargo-fuzz --locked" >&2; exit 2; }
rustup run nightly rustc --version >/dev/null 2>&1 || { echo "needs a nightly toolchain (rustup toolchain install nightly)" >&2; exit 2; }
mkdir -p "$OUT"
# The corpus grown by the recorded runs (minimized with `cargo fuzz cmin`) is kept as one archive.
if [ ! -d fuzz/corpus ] && [ -f fuzz/corpus.tar.gz ]; then
  tar -xzf fuzz/corpus.tar.gz -C fuzz
fi
for t in $TARGETS; do
  mkdir -p "fuzz/corpus/$t"
  echo "== $t: ${SECONDS_EACH}s" >&2
  cargo +nightly fuzz run -O "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$SECONDS_EACH" -print_final_stats=1 >"$OUT/$t.full.log" 2>&1 || {
    tail -40 "$OUT/$t.full.log" >&2
    echo "$t: CRASH (see fuzz/artifacts/$t)" >&2
    exit 1
  }
  grep -E "^Done|stat::number_of_executed_units|stat::peak_rss_mb|cov:" "$OUT/$t.full.log" | tail -4 >"$OUT/$t.log"
  echo "$t: $(grep -E '^Done' "$OUT/$t.full.log")" >&2
done
