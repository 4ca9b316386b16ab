# shellcheck shell=bash
# Shared by setup.sh and test.sh (sourced, not run): which virtiofsd vmctl will run, so
# that they check that one, not merely the one setup installed; and the AppArmor profile
# that lets it make its sandbox where Ubuntu (23.10 and later) forbids that to
# unprivileged programs.

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

# The file setup writes the profile to: the README's, so that a profile made by hand
# from the README is not joined by a second one for the same binary (AppArmor refuses
# to run a program that two profiles claim alike).
virtiofsd_apparmor_file=/etc/apparmor.d/virtiofsd
# The first line of the profile setup writes: a file without it is not setup's to
# replace.
virtiofsd_apparmor_marker="# Written by vmctl's scripts/setup.sh: virtiofsd may make its sandbox's namespaces."
# The profiles the kernel has loaded, one "name (mode)" a line; only root may read it.
virtiofsd_apparmor_loaded=/sys/kernel/security/apparmor/profiles

# Says 1 where AppArmor keeps unprivileged programs without a profile from making
# namespaces inside a user namespace (Ubuntu 23.10 and later).
# shellcheck disable=SC2034 # setup.sh's; the tests give the function a file of their own
apparmor_userns_sysctl=/proc/sys/kernel/apparmor_restrict_unprivileged_userns

# apparmor_restricts_userns SYSCTL_FILE: whether SYSCTL_FILE (apparmor_userns_sysctl)
# says AppArmor restricts user namespaces, which virtiofsd's sandbox makes.
apparmor_restricts_userns() {
    local sysctl="$1" value
    [[ -r "$sysctl" ]] || return 1
    read -r value <"$sysctl" || return 1
    [[ "$value" == 1 ]]
}

# virtiofsd_apparmor_profile BINARY: prints the README's profile, which allows BINARY
# to make user namespaces and everything in them; BINARY with its links resolved, as
# AppArmor attaches a profile to the file a process executes. Fails, printing nothing,
# for a path AppArmor would read as a pattern or could not quote.
virtiofsd_apparmor_profile() {
    local binary
    binary="$(readlink -f -- "$1")" || return 1
    [[ "$binary" == /* && "$binary" != *[\"\\*?{}^@]* && "$binary" != *[][]* &&
        "$binary" != *$'\n'* ]] || return 1
    cat <<EOF
$virtiofsd_apparmor_marker
abi <abi/4.0>,
include <tunables/global>
profile virtiofsd "$binary" flags=(unconfined) {
  userns,
}
EOF
}

# virtiofsd_apparmor_install BINARY [PREFIX...]: makes sure BINARY has the README's
# AppArmor profile, running what needs root through PREFIX (sudo; nothing as root):
# writes virtiofsd_apparmor_file and loads it (apparmor_parser -r). Prints what it did:
# "installed", "up to date" (the file says that, and it is loaded), or "kept" (the file
# is not setup's but names BINARY: someone's own profile, from the README). Returns 1,
# having said why on stderr, where it could not; it never replaces a file that is not
# setup's.
virtiofsd_apparmor_install() {
    local binary="$1" profile resolved existing listed
    shift
    profile="$(virtiofsd_apparmor_profile "$binary")" || {
        echo "cannot write an AppArmor profile for $binary: its path holds a character AppArmor reads as a pattern" >&2
        return 1
    }
    resolved="$(readlink -f -- "$binary")"
    existing="$(cat -- "$virtiofsd_apparmor_file" 2>/dev/null || true)"
    # Only root may read the list of loaded profiles (grep's 2): then the file is
    # trusted, as AppArmor loads the directory's profiles at each boot.
    listed=0
    grep -qs '^virtiofsd ' "$virtiofsd_apparmor_loaded" || listed=$?
    if [[ "$existing" == "$profile" ]] && ((listed != 1)); then
        echo "up to date"
        return 0
    fi
    if [[ -e "$virtiofsd_apparmor_file" && "${existing%%$'\n'*}" != "$virtiofsd_apparmor_marker" ]]; then
        if grep -qF -- "$resolved" <<<"$existing"; then
            echo "kept"
            return 0
        fi
        echo "$virtiofsd_apparmor_file exists, was not written by setup, and does not name $resolved: add that path to it (the README's profile), or remove it and run setup again" >&2
        return 1
    fi
    printf '%s\n' "$profile" | "$@" tee -- "$virtiofsd_apparmor_file" >/dev/null || {
        echo "could not write $virtiofsd_apparmor_file" >&2
        return 1
    }
    "$@" apparmor_parser -r "$virtiofsd_apparmor_file" || {
        # (Not looked for first: it is in /usr/sbin, which a user's PATH may lack.)
        echo "'apparmor_parser -r $virtiofsd_apparmor_file' failed (is the package apparmor installed?)" >&2
        return 1
    }
    echo "installed"
}
