# Shared by the build scripts that keep artifacts in vmctl's cache (sourced, not run):
# how an entry is published, marked as used, and pruned. An entry is a directory named
# after the hash of its inputs; the scripts' own text is one of those inputs, this
# file's included.

# Days an entry of an older key may go unused before a new build of the same kind
# removes it (VMCTL_CACHE_KEEP_DAYS).
cache_keep_days="${VMCTL_CACHE_KEEP_DAYS:-30}"

# cache_key_of_scripts FILE...: the hash of the build's own scripts, for its key.
cache_key_of_scripts() {
    cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16
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
# CURRENT, that went unused for cache_keep_days (a VM still running from one keeps its
# open file), and what builds killed outright left behind (their work and unpublished
# directories, `*.tmp*` and `build.*`, and failure logs) once a day old: no build
# runs that long.
cache_prune() {
    local parent="$1" pattern="$2" current="$3" entry
    while IFS= read -r -d '' entry; do
        [[ "$entry" == "$current" ]] && continue
        echo "cache: removing $entry (unused for over $cache_keep_days days)" >&2
        rm -rf --one-file-system "$entry"
    done < <(find "$parent" -mindepth 1 -maxdepth 1 -type d -name "$pattern" ! -name '*.tmp*' \
                  -mtime +"$cache_keep_days" -print0 2>/dev/null)
    while IFS= read -r -d '' entry; do
        echo "cache: removing $entry (left by a build that was killed)" >&2
        rm -rf --one-file-system "$entry"
    done < <(find "$parent" -mindepth 1 -maxdepth 1 \( -name '*.tmp*' -o -name 'build.*' \
                  -o -name '*.failed.log' \) -mtime +0 -print0 2>/dev/null)
}
