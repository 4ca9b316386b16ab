#!/usr/bin/env bash
# Runs libFuzzer on one harness for a while: fuzz/run.sh mmio|vsock|fs_fallback|redact [SECONDS]
# (default 60). An input that runs over 10 s counts as a hang. Seeds come from the
# hand-written sessions (src/seeds.rs); the corpus grows in
# fuzz/libfuzzer/corpus/<target>, crashes and hangs land in fuzz/libfuzzer/artifacts/.
# FUZZ_RUNS=N runs N inputs instead, from a fixed seed and the hand-written seeds (on a
# clean clone, as CI has): a bounded run that starts the same way every time. (The
# harnesses' real sockets and files make coverage vary a little between runs, and with
# it the later inputs.)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
target=${1:?usage: fuzz/run.sh mmio|vsock|fs_fallback|redact [SECONDS]}
seconds=${2:-60}
case $target in
    mmio | vsock | fs_fallback | redact) ;;
    *) echo "fuzz/run.sh: no harness '$target' (mmio, vsock, fs_fallback or redact)" >&2; exit 2 ;;
esac
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz/run.sh: cargo-fuzz is missing; install it with: cargo install cargo-fuzz --version 0.13.2 --locked" >&2
    exit 2
fi

cargo run -q --release --manifest-path "$here/Cargo.toml" --bin fuzz-seeds -- "$here/libfuzzer/corpus"
cd "$here/libfuzzer"
# cargo fuzz builds with nightly-only flags (the sanitizer); RUSTC_BOOTSTRAP lets this
# machine's stable toolchain take them.
if [[ -n ${FUZZ_RUNS:-} ]]; then
    budget=(-runs="$FUZZ_RUNS" -seed=1)
else
    budget=(-max_total_time="$seconds")
fi
RUSTC_BOOTSTRAP=1 exec cargo fuzz run --fuzz-dir . "$target" "corpus/$target" -- \
    "${budget[@]}" -rss_limit_mb=2048 -timeout=10
