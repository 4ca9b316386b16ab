# shellcheck shell=bash
# Shared by setup.sh (sourced, not run): whether the cargo that builds this checkout is
# new enough for it (Cargo.lock's format, the standard library's APIs the code uses):
# at least the release rust-toolchain.toml pins. Under rustup that file makes cargo
# that release (fetched on first use); a distribution's cargo, or one from elsewhere,
# ignores it, and may be older (Debian 12's is 1.65).

# rust_pinned_version TOML: prints the release TOML (a rust-toolchain.toml) pins as its
# channel, such as "1.95.0"; fails, printing nothing, where it pins none (a channel such
# as "stable" names no version to compare with).
rust_pinned_version() {
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        if [[ "$line" =~ ^[[:space:]]*channel[[:space:]]*=[[:space:]]*\"([0-9]+\.[0-9]+(\.[0-9]+)?)\"[[:space:]]*(#.*)?$ ]]; then
            echo "${BASH_REMATCH[1]}"
            return 0
        fi
    done <"$1"
    return 1
}

# rust_version_at_least HAVE WANT: whether the version HAVE (X.Y.Z, or X.Y) is WANT or
# later, part by part as numbers (1.100 is later than 1.95); a missing part is 0.
rust_version_at_least() {
    local have want i
    IFS=. read -ra have <<<"$1"
    IFS=. read -ra want <<<"$2"
    for i in 0 1 2; do
        # Base 10: a part such as "08" is not octal.
        local h=$((10#${have[i]:-0})) w=$((10#${want[i]:-0}))
        ((h == w)) || return $((h < w))
    done
    return 0
}

# cargo_version_in DIR [CARGO]: prints the version CARGO (default: cargo) says it is
# (`cargo --version`: "cargo 1.95.0 (f2d3ce0bd 2026-03-21)" gives 1.95.0; a suffix
# such as "-nightly" is dropped), run in DIR, where rustup applies DIR's
# rust-toolchain.toml. Only its stdout is read: rustup says on stderr what it
# downloads when the pinned release is not installed yet, and that, like cargo's
# errors, goes to this function's stderr. Fails if cargo does, or says no version.
cargo_version_in() {
    local dir="$1" cargo="${2:-cargo}" said line
    said="$(cd "$dir" && "$cargo" --version </dev/null)" || return 1
    while IFS= read -r line; do
        if [[ "$line" =~ ^cargo\ ([0-9]+\.[0-9]+\.[0-9]+) ]]; then
            echo "${BASH_REMATCH[1]}"
            return 0
        fi
    done <<<"$said"
    return 1
}

# rust_toolchain_problem ROOT [CARGO]: nothing if CARGO (default: cargo), run in the
# checkout ROOT, is at least the release ROOT/rust-toolchain.toml pins; else prints what
# is wrong (the version found, the one needed, where to get it) and fails.
rust_toolchain_problem() {
    local root="$1" cargo="${2:-cargo}" pinned found where
    local get="install Rust through rustup (https://rustup.rs), which fetches the release rust-toolchain.toml pins on first use, then rerun"
    if ! pinned="$(rust_pinned_version "$root/rust-toolchain.toml")"; then
        echo "$root/rust-toolchain.toml pins no Rust release (channel = \"X.Y.Z\"), which the check of cargo's version needs"
        return 1
    fi
    if ! where="$(command -v "$cargo")"; then
        echo "cargo is missing; this checkout needs Rust $pinned or later: $get"
        return 1
    fi
    if ! found="$(cargo_version_in "$root" "$cargo")"; then
        echo "'$cargo --version' ($where) in $root failed or said no version (its words above); this checkout needs Rust $pinned or later: $get"
        return 1
    fi
    if ! rust_version_at_least "$found" "$pinned"; then
        echo "cargo $found ($where) is too old for this checkout, which needs Rust $pinned or later (rust-toolchain.toml: Cargo.lock's format and the standard library's APIs the code uses; a distribution's cargo, such as Debian 12's 1.65, is older): $get"
        return 1
    fi
}
