# shellcheck shell=bash
# Shared by setup.sh (sourced, not run): which virtiofsd vmctl will run, so that setup
# checks that one, not merely the one it installed.

# vmctl_virtiofsd: prints the virtiofsd vmctl would run with this environment, found
# as vmctl finds it (vmctl/src/virtiofsd/binary.rs): $VMCTL_VIRTIOFSD as it is; else
# the first executable file named virtiofsd in PATH's absolute directories, then
# $HOME/.cargo/bin, /usr/libexec and /usr/lib/qemu. Prints nothing if there is none.
vmctl_virtiofsd() {
    local dir candidate dirs=() candidates=()
    if [[ -n "${VMCTL_VIRTIOFSD:-}" ]]; then
        echo "$VMCTL_VIRTIOFSD"
        return 0
    fi
    IFS=: read -ra dirs <<<"${PATH:-}"
    for dir in "${dirs[@]}"; do
        # vmctl skips relative entries (a workspace must not plant its own daemon).
        [[ "$dir" != /* ]] || candidates+=("$dir/virtiofsd")
    done
    [[ -z "${HOME:-}" ]] || candidates+=("$HOME/.cargo/bin/virtiofsd")
    candidates+=(/usr/libexec/virtiofsd /usr/lib/qemu/virtiofsd)
    for candidate in "${candidates[@]}"; do
        if [[ -f "$candidate" && -x "$candidate" ]]; then
            echo "$candidate"
            return 0
        fi
    done
}
