# shellcheck shell=bash
# Shared by setup.sh (sourced, not run): which virtiofsd vmctl will run, so that setup
# checks that one, not merely the one it installed.

# The oldest virtiofsd vmctl runs (MIN_VERSION in vmctl/src/virtiofsd/binary.rs).
virtiofsd_min_version=1.14.0

# virtiofsd_version_line FILE: the first line FILE prints for --version (nothing if it
# cannot run, fails or takes over 10 s), run as vmctl runs it: no environment.
virtiofsd_version_line() {
    timeout 10 env -i -- "$1" --version 2>/dev/null </dev/null | head -n1 || true
}

# virtiofsd_is_recent FILE: whether FILE is an executable file that says it is the
# Rust virtiofsd, virtiofsd_min_version or later, as vmctl reads its --version line:
# "virtiofsd 1.14.0" (a suffix such as "-rc1" is ignored); QEMU's older C virtiofsd
# says "virtiofsd version 7.2.0 ...", which is not that.
virtiofsd_is_recent() {
    local line minimum
    [[ -f "$1" && -x "$1" ]] || return 1
    line="$(virtiofsd_version_line "$1")"
    # vmctl trims the line, then reads three dot-separated parts, each from its leading
    # digits.
    line="${line#"${line%%[![:space:]]*}"}"
    [[ "$line" =~ ^virtiofsd\ ([0-9]+)[^.]*\.([0-9]+)[^.]*\.([0-9]+) ]] || return 1
    local found=("${BASH_REMATCH[@]:1:3}")
    IFS=. read -ra minimum <<<"$virtiofsd_min_version"
    local i
    for i in 0 1 2; do
        # Base 10: a part such as "08" is not octal.
        local have=$((10#${found[i]})) want=$((10#${minimum[i]}))
        ((have == want)) || return $((have < want))
    done
    return 0
}

# vmctl_virtiofsd [SEARCH_PATH]: prints the virtiofsd vmctl would run with this
# environment and SEARCH_PATH (default: PATH) as its PATH, found as vmctl finds it
# (vmctl/src/virtiofsd/binary.rs): $VMCTL_VIRTIOFSD as it is (vmctl uses or refuses
# it, never looks elsewhere); else the first executable file named virtiofsd in
# SEARCH_PATH's absolute directories, then $HOME/.cargo/bin, /usr/libexec and
# /usr/lib/qemu, that is recent (virtiofsd_is_recent): vmctl passes older ones over.
# Prints nothing if there is none.
vmctl_virtiofsd() {
    local search_path="${1-${PATH:-}}" dir candidate dirs=() candidates=()
    if [[ -n "${VMCTL_VIRTIOFSD:-}" ]]; then
        echo "$VMCTL_VIRTIOFSD"
        return 0
    fi
    IFS=: read -ra dirs <<<"$search_path"
    for dir in "${dirs[@]}"; do
        # vmctl skips relative entries (a workspace must not plant its own daemon).
        [[ "$dir" != /* ]] || candidates+=("$dir/virtiofsd")
    done
    [[ -z "${HOME:-}" ]] || candidates+=("$HOME/.cargo/bin/virtiofsd")
    candidates+=(/usr/libexec/virtiofsd /usr/lib/qemu/virtiofsd)
    for candidate in "${candidates[@]}"; do
        if virtiofsd_is_recent "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
}
