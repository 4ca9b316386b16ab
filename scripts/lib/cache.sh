# shellcheck shell=bash
# Shared by the build scripts that keep artifacts in vmctl's cache (sourced, not run):
# how an entry is published, marked as used, and pruned. An entry is a directory named
# after the hash of its inputs; the scripts' own text is one of those inputs, this
# file's included.

# A relative VMCTL_CACHE_DIR is taken from where the build was started: the kernel's
# build runs in its work directory, where it would name another place.
if [[ -n "${VMCTL_CACHE_DIR:-}" && "$VMCTL_CACHE_DIR" != /* ]]; then
    VMCTL_CACHE_DIR="$PWD/$VMCTL_CACHE_DIR"
fi

# Days an entry of an older key may go unused before a new build of the same kind
# removes it (VMCTL_CACHE_KEEP_DAYS).
cache_keep_days="${VMCTL_CACHE_KEEP_DAYS:-30}"
# How many entries of older keys a new build of the same kind keeps at most, the most
# recently used (VMCTL_CACHE_KEEP_OLDER): each edit of a build script is a new key, and
# a root image is 1.6 GB.
cache_keep_older="${VMCTL_CACHE_KEEP_OLDER:-2}"

# cache_key_of_scripts FILE...: the hash of the build's own scripts, for its key.
cache_key_of_scripts() {
    cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16
}

# cache_owner ROOT: prints "uid:gid" of the user whose cache ROOT is when root builds
# into it for them under sudo (SUDO_UID; `sudo -E vmctl` keeps their HOME), else
# nothing. Theirs means its nearest existing directory is theirs: what root left there
# (a lock, a directory for the next mktemp) would fail their next build, while root's
# own cache (sudo's HOME=/root) stays root's.
cache_owner() {
    local dir="$1"
    [[ $(id -u) == 0 && -n "${SUDO_UID:-}" && "$SUDO_UID" != 0 ]] || return 0
    while [[ ! -e "$dir" ]]; do dir="$(dirname "$dir")"; done
    [[ "$(stat -c %u -- "$dir")" == "$SUDO_UID" ]] || return 0
    echo "$SUDO_UID:${SUDO_GID:-$SUDO_UID}"
}

# cache_unwritable_for UID:GID ROOT KIND: prints the first of ROOT, its directory
# KIND and KIND's entries (locks, cache entries, work directories) that the user could
# not write (asked as them: modes, groups and ACLs all count), "?" if they could not
# be asked; nothing if they could write it all. An earlier build as root (before
# builds ran as the cache's owner) may have left such entries, and the build, its lock
# or its pruning would fail on them. Other kinds' entries are not this build's.
cache_unwritable_for() {
    local owner="$1" root="$2" kind="$3" found
    [[ -e "$root" ]] || return 0
    found="$(setpriv --reuid="${owner%:*}" --regid="${owner#*:}" --init-groups -- \
        find "$root" -maxdepth 0 ! -writable -print -quit 2>/dev/null)" || found="${found:-?}"
    if [[ -z "$found" && -e "$root/$kind" ]]; then
        found="$(setpriv --reuid="${owner%:*}" --regid="${owner#*:}" --init-groups -- \
            find "$root/$kind" -maxdepth 1 ! -type l ! -writable -print -quit 2>/dev/null)" ||
            found="${found:-?}"
    fi
    echo "$found"
}

# cache_build_as_owner ROOT KIND COMMAND...: for a build that needs no root, into
# ROOT/KIND. When root would build into a user's cache (cache_owner), runs COMMAND
# (the script again) as that user, with their home, so that everything the build makes
# is theirs, a work directory a kill left behind included; does not return then.
# Otherwise returns, also when the user could not write all the build would (root
# then builds, as before, and says why and what to do).
cache_build_as_owner() {
    local root="$1" kind="$2" owner home unwritable
    shift 2
    owner="$(cache_owner "$root")"
    [[ -n "$owner" ]] || return 0
    unwritable="$(cache_unwritable_for "$owner" "$root" "$kind")"
    if [[ -n "$unwritable" ]]; then
        [[ "$unwritable" != "?" ]] || unwritable="what it holds (asking as them failed)"
        echo "cache: $root is uid ${owner%:*}'s, but they could not write $unwritable (left by an earlier build as root?): building as root; 'sudo chown -R ${owner%:*} $root' has later builds run as them" >&2
        return 0
    fi
    home="$(getent passwd "${owner%:*}" | cut -d: -f6)"
    echo "cache: $root is uid ${owner%:*}'s: building as that user" >&2
    exec setpriv --reuid="${owner%:*}" --regid="${owner#*:}" --init-groups -- \
        env VMCTL_CACHE_DIR="$root" ${home:+HOME="$home"} "$@"
}

# cache_publish TMP OUT FILE: makes TMP's files durable, then renames TMP to OUT, so
# OUT is either absent or whole, even across a crash. When a build of the same key
# finished first (OUT holds FILE), OUT is theirs and TMP is dropped; an OUT without
# FILE (emptied by hand) is replaced.
cache_publish() {
    local tmp="$1" out="$2" file="$3"
    find "$tmp" -type f -exec sync {} +
    if ! mv -T "$tmp" "$out" 2>/dev/null; then
        if [[ -f "$out/$file" ]]; then
            rm -rf "$tmp"
        else
            echo "cache: replacing $out, which lacks its $file" >&2
            rm -rf --one-file-system "$out"
            mv -T "$tmp" "$out" || { echo "cache: cannot rename $tmp to $out" >&2; return 1; }
        fi
    fi
    sync "$(dirname "$out")"
}

# cache_mark_used OUT: what cache_prune keeps.
cache_mark_used() {
    touch -c "$1" 2>/dev/null || true
}

# cache_prune PARENT PATTERN CURRENT: removes PARENT's entries named PATTERN, other than
# CURRENT, that went unused for cache_keep_days, and those past the cache_keep_older
# most recently used (a VM still running from one keeps its open file); and what
# builds killed outright left behind (their work and unpublished directories, `*.tmp*`
# and `build.*`, and failure logs) once a day old: no build runs that long.
cache_prune() {
    local parent="$1" pattern="$2" current="$3" line entry used kept=0 now
    now="$(date +%s)"
    # Most recently used first: "SECONDS.FRACTION PATH", one a line (entries are named
    # by hashes).
    while IFS= read -r line; do
        entry="${line#* }" used="${line%%.*}"
        [[ "$entry" == "$current" ]] && continue
        kept=$((kept + 1))
        if ((now - used > cache_keep_days * 86400)); then
            echo "cache: removing $entry (unused for over $cache_keep_days days)" >&2
        elif ((kept > cache_keep_older)); then
            echo "cache: removing $entry (older than the $cache_keep_older last used)" >&2
        else
            continue
        fi
        rm -rf --one-file-system "$entry"
    done < <(find "$parent" -mindepth 1 -maxdepth 1 -type d -name "$pattern" ! -name '*.tmp*' \
                  -printf '%T@ %p\n' 2>/dev/null | sort -rn)
    while IFS= read -r -d '' entry; do
        echo "cache: removing $entry (left by a build that was killed)" >&2
        rm -rf --one-file-system "$entry"
    done < <(find "$parent" -mindepth 1 -maxdepth 1 \( -name '*.tmp*' -o -name 'build.*' \
                  -o -name '*.failed.log' \) -mtime +0 -print0 2>/dev/null)
}
