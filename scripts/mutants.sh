#!/usr/bin/env bash
# Mutation testing of the pure core with cargo-mutants (pinned): the content
# hash (src/hash/), the change decision (src/diff.rs), event ids (src/event.rs), the
# state codec and the intent journal (src/state/codec.rs, src/state/journal.rs),
# against the tests that cover them (the library's unit tests and the golden
# vectors). Not part of .ci/run: it builds the library once per mutant.
#   bash scripts/mutants.sh [extra cargo-mutants args, e.g. --shard 0/4 or -F plan_change]
# Results: $MUTANTS_OUT/mutants.out/ (default ./mutants.out/: outcomes.json,
# caught.txt, missed.txt, timeout.txt). Shards are round-robin, so each one is an
# evenly spread sample; give each its own MUTANTS_OUT.
# Speed (measured on the shared 2-core box, 2026-11-24): the build is limited to
# the two test targets that run (--lib, --test golden) through --cargo-arg: with
# the targets only after `--`, cargo-mutants built every integration test and
# the binary for each mutant (~25 s a mutant instead of ~5-10 s). The target
# dir keeps the default dev profile so it can be seeded from any warm debug
# target of this crate; dropping debuginfo or linking with mold (RUSTFLAGS or
# a linker override) rebuilt every dependency (~13 min here) and saved no
# measurable time on the incremental rebuild of the crate (rustc already links
# with rust-lld). --timeout 30: the tests take ~1 s, and a mutant that loops
# forever otherwise costs 120 s. The whole set (533 mutants) takes ~2 h 40 min
# at 10-20 s a mutant on the shared machine; a shard --shard k/4 ~40 min.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=25.3.1
CACHE="${VCDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voucher-cdc}"
ROOT="$CACHE/cargo-mutants-$VERSION"
if [ ! -x "$ROOT/bin/cargo-mutants" ]; then
  echo "==> installing cargo-mutants $VERSION into $ROOT" >&2
  cargo install cargo-mutants --version "$VERSION" --locked --root "$ROOT"
fi
export PATH="$ROOT/bin:$PATH"
# Its own target dir: mutated builds never disturb the test suite's cache.
export CARGO_TARGET_DIR="${MUTANTS_TARGET_DIR:-$CACHE/target-mutants}"

OUT="${MUTANTS_OUT:-.}"
mkdir -p "$OUT"
cargo mutants --version
# nice: the other developers' builds keep priority on the shared machine.
rc=0
nice -n 10 cargo mutants \
  --file src/hash/mod.rs \
  --file src/hash/canonical.rs \
  --file src/diff.rs \
  --file src/event.rs \
  --file src/state/codec.rs \
  --file src/state/journal.rs \
  --timeout 30 \
  --output "$OUT" \
  --cargo-arg=--lib \
  --cargo-arg=--test=golden \
  "$@" || rc=$?

missed="$OUT/mutants.out/missed.txt"
caught="$OUT/mutants.out/caught.txt"
timeout="$OUT/mutants.out/timeout.txt"
n_missed=$(wc -l <"$missed" 2>/dev/null || echo 0)
n_caught=$(wc -l <"$caught" 2>/dev/null || echo 0)
n_timeout=$(wc -l <"$timeout" 2>/dev/null || echo 0)
echo "mutants: caught $n_caught, timed out $n_timeout (counted as caught), missed $n_missed"
exit "$rc"
