#!/usr/bin/env bash
# Mutation testing of the pure core with cargo-mutants (pinned): the content
# hash (src/hash/), the change decision (src/diff.rs), event ids (src/event.rs), the
# state codec and the intent journal (src/state/codec.rs, src/state/journal.rs),
# against the tests that cover them (the library's unit tests and the golden
# vectors). Not part of .ci/run: it builds the library once per mutant.
#   bash scripts/mutants.sh [extra cargo-mutants args, e.g. --shard 0/4 or -F plan_change]
# Results: mutants.out/ (outcomes.json, caught.txt, missed.txt, timeout.txt).
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

cargo mutants --version
cargo mutants \
  --file src/hash/mod.rs \
  --file src/hash/canonical.rs \
  --file src/diff.rs \
  --file src/event.rs \
  --file src/state/codec.rs \
  --file src/state/journal.rs \
  --timeout 120 \
  --output . \
  "$@" \
  -- --lib --test golden

missed="mutants.out/missed.txt"
caught="mutants.out/caught.txt"
timeout="mutants.out/timeout.txt"
n_missed=$(wc -l <"$missed" 2>/dev/null || echo 0)
n_caught=$(wc -l <"$caught" 2>/dev/null || echo 0)
n_timeout=$(wc -l <"$timeout" 2>/dev/null || echo 0)
echo "mutants: caught $n_caught, timed out $n_timeout (counted as caught), missed $n_missed"
