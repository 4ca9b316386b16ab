//! The workspace and extra shares through virtio-fs (virtiofsd): file operations both
//! ways, a large file, mmap, git on both sides, read-only shares, isolation from the
//! rest of the host, and a virtiofsd that dies under a running VM.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use vm_tests::{stdout, vm_available, vmctl_bin, TempDir, Workspace};

fn host(program: &str, args: &[&str], dir: &Path) -> String {
    let output = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout(&output)
}

fn assert_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed in the guest: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_workspace_is_shared_at_its_host_path() {
    if !vm_available("virtio_fs::the_workspace_is_shared_at_its_host_path") {
        return;
    }
    vm_tests::retry_if_vm_lost(shared_workspace_scenario);
}

fn shared_workspace_scenario() {
    let ws = Workspace::new("virtio-fs");
    let root = ws.path().canonicalize().unwrap();
    let read_only = ws.dir.join("ro");
    std::fs::create_dir_all(&read_only).unwrap();
    std::fs::write(read_only.join("data.txt"), "read-only data\n").unwrap();
    let outside = ws.dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let marker = vm_tests::random_hex(16);
    std::fs::write(outside.join("secret.txt"), &marker).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", root.join("shadow-link")).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.txt"), root.join("secret-link")).unwrap();
    std::fs::write(root.join("host-made.txt"), "made on the host\n").unwrap();

    let mount = format!("{}:/data:ro", read_only.display());
    assert_ok(&ws.run(&["up", "--mount", &mount]), "vmctl up");

    // The working directory is the workspace, at its host path, with the host's file.
    let here = ws.exec("pwd; cat host-made.txt");
    assert_ok(&here, "pwd");
    assert_eq!(
        stdout(&here),
        format!("{}\nmade on the host\n", root.display())
    );

    // Every kind of change made in the guest, seen on the host.
    assert_ok(
        &ws.exec(
            "set -e
             printf hello > created.txt; printf ' world' >> created.txt
             printf 0123456789 > truncated.txt; truncate -s 4 truncated.txt
             printf moved > before.txt; mv before.txt after.txt
             printf linked > original.txt; ln original.txt hardlink.txt
             ln -s after.txt symlink.txt
             printf x > mode.txt; chmod 0640 mode.txt
             mkdir -p dir/sub; rmdir dir/sub
             printf gone > deleted.txt; rm deleted.txt",
        ),
        "file operations",
    );
    let read = |name: &str| std::fs::read_to_string(root.join(name)).unwrap();
    assert_eq!(read("created.txt"), "hello world");
    assert_eq!(read("truncated.txt"), "0123");
    assert_eq!(read("after.txt"), "moved");
    assert!(!root.join("before.txt").exists());
    let original = std::fs::metadata(root.join("original.txt")).unwrap();
    let hardlink = std::fs::metadata(root.join("hardlink.txt")).unwrap();
    assert_eq!((original.ino(), original.nlink()), (hardlink.ino(), 2));
    assert_eq!(
        std::fs::read_link(root.join("symlink.txt")).unwrap(),
        Path::new("after.txt")
    );
    let mode = std::fs::metadata(root.join("mode.txt")).unwrap();
    assert_eq!(mode.permissions().mode() & 0o777, 0o640);
    assert!(root.join("dir").is_dir() && !root.join("dir/sub").exists());
    assert!(!root.join("deleted.txt").exists());
    // Files the guest's default user creates belong to whoever ran vmctl.
    let owner = std::fs::metadata(&root).unwrap().uid();
    assert_eq!(
        std::fs::metadata(root.join("created.txt")).unwrap().uid(),
        owner
    );

    // The host's changes, seen in the guest promptly (attribute cache: 1 s).
    std::fs::write(root.join("host-made.txt"), "changed on the host\n").unwrap();
    std::fs::write(root.join("new-on-host.txt"), "new\n").unwrap();
    assert_ok(
        &ws.exec(
            "for i in $(seq 50); do
                 grep -q changed host-made.txt && test -e new-on-host.txt && exit 0
                 sleep 0.1
             done; exit 1",
        ),
        "seeing the host's edits",
    );

    // 64 MiB written in the guest arrives intact. (Written in 1 MiB blocks: through the
    // nested host every small write is slow.)
    let big = ws.exec(
        "head -c 67108864 /dev/urandom > /tmp/big.bin && \
         dd if=/tmp/big.bin of=big.bin bs=1M status=none && sha256sum big.bin",
    );
    assert_ok(&big, "writing 64 MiB");
    assert_eq!(
        stdout(&big).split_whitespace().next(),
        host("sha256sum", &["big.bin"], &root)
            .split_whitespace()
            .next()
    );

    // Shared mmap writes reach the host's file; mmap reads see the host's bytes.
    std::fs::write(root.join("mapped-by-host.bin"), "host bytes").unwrap();
    let mmap = ws.exec(
        "python3 -c \"
import mmap
with open('mm.bin', 'wb') as f:
    f.write(bytes(8192))
with open('mm.bin', 'r+b') as f:
    m = mmap.mmap(f.fileno(), 8192)
    m[4096:4101] = b'MMAPW'
    m.flush()
    m.close()
with open('mapped-by-host.bin', 'rb') as f:
    print(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)[:].decode())
\"",
    );
    assert_ok(&mmap, "mmap");
    assert_eq!(stdout(&mmap), "host bytes\n");
    let mapped = std::fs::read(root.join("mm.bin")).unwrap();
    assert_eq!(&mapped[4096..4101], b"MMAPW");

    // git on both sides of the same repository.
    assert_ok(
        &ws.exec(
            "set -e; git init -q repo; cd repo
             git config user.email guest@example.com; git config user.name guest
             echo a > a.txt; git add a.txt; git commit -qm guest-commit
             test -z \"$(git status --porcelain)\"",
        ),
        "git in the guest",
    );
    let repo = root.join("repo");
    assert_eq!(
        host("git", &["log", "--format=%s"], &repo),
        "guest-commit\n"
    );
    assert_eq!(host("git", &["status", "--porcelain"], &repo), "");
    std::fs::write(repo.join("b.txt"), "b\n").unwrap();
    host("git", &["add", "b.txt"], &repo);
    host(
        "git",
        &[
            "-c",
            "user.name=host",
            "-c",
            "user.email=host@example.com",
            "commit",
            "-qm",
            "host-commit",
        ],
        &repo,
    );
    // The guest may hold names and attributes for up to a second (cache=auto), so it
    // sees the host's new index within that window, not necessarily at once.
    let guest_log = ws.exec(
        "cd repo
         for i in $(seq 30); do
             [ -z \"$(git status --porcelain)\" ] && break
             sleep 0.1
         done
         git log --format=%s && git status --porcelain",
    );
    assert_ok(&guest_log, "git log in the guest");
    assert_eq!(stdout(&guest_log), "host-commit\nguest-commit\n");

    // A read-only share reads, and refuses writes whoever the guest user is.
    let ro = ws.exec("cat /data/data.txt; echo x > /data/new.txt");
    assert_eq!(stdout(&ro), "read-only data\n");
    assert!(!ro.status.success());
    assert!(
        String::from_utf8_lossy(&ro.stderr).contains("Read-only file system"),
        "a write to a read-only share did not fail with EROFS"
    );
    assert!(!read_only.join("new.txt").exists());

    // Nothing outside the shares: not the directory beside the workspace, not
    // through a symlink the host placed inside it.
    let outside_guest = ws.run(&[
        "exec",
        "--",
        "sh",
        "-c",
        &format!(
            "test -e '{}' && echo REACHABLE; cat secret-link 2>/dev/null; true",
            outside.display()
        ),
    ]);
    assert_ok(&outside_guest, "probing outside the shares");
    assert!(!stdout(&outside_guest).contains("REACHABLE"));
    assert!(!stdout(&outside_guest).contains(&marker));
    let shadow = ws.exec("cat shadow-link 2>&1; true");
    let host_shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    assert!(
        host_shadow.is_empty() || stdout(&shadow) != host_shadow,
        "the guest read the host's /etc/shadow through a symlink"
    );
}

/// virtiofsd killed under a running VM: requests fail (no hang), `vmctl` says what
/// happened, the host's files stay intact. Runs `vmctl` inside the nested host itself
/// so the test can reach the virtiofsd process; that also covers the direct-KVM path.
#[test]
fn a_dead_virtiofsd_is_reported_not_hung_on() {
    if !vm_available("virtio_fs::a_dead_virtiofsd_is_reported_not_hung_on") {
        return;
    }
    let dir = TempDir::new("virtio-fs-kill");
    let ws = dir.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("kept.txt"), "kept\n").unwrap();
    let vmctl = vmctl_bin().display().to_string();
    let script = format!(
        "set -u
         export XDG_STATE_HOME=/tmp/vmctl-state
         cd '{ws}'
         {vmctl} up || exit 10
         {vmctl} exec -- sh -c 'echo before > before.txt' || exit 11
         for comm in /proc/[0-9]*/comm; do
             [ \"$(cat $comm 2>/dev/null)\" = virtiofsd ] || continue
             pid=${{comm#/proc/}}; kill -KILL ${{pid%/comm}}
         done
         sleep 2
         cd /
         timeout 120 {vmctl} exec --workspace '{ws}' -- cat '{ws}/kept.txt' > after.out 2>&1
         echo \"exec-after-kill=$?\"
         cat after.out
         cd '{ws}'
         timeout 120 {vmctl} exec -- true > after.out 2>&1
         echo \"exec-after-kill=$?\"
         cat after.out
         {vmctl} ps
         timeout 120 {vmctl} rm; echo \"rm=$?\"",
        ws = ws.display()
    );
    let output = Command::new(vmctl_bin())
        .args(["nested-exec", "--writable"])
        .arg(&ws)
        .args(["--", "sh", "-c", &script])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        stdout(&output),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{text}");
    assert!(output.status.success(), "the nested script failed");
    assert!(text.contains("exec-after-kill="), "no exec after the kill");
    assert!(
        !text.contains("exec-after-kill=124"),
        "an exec touching the share hung after virtiofsd died"
    );
    assert!(
        text.contains("Input/output error"),
        "the guest did not get EIO from the dead share"
    );
    assert!(
        text.contains("virtiofsd") && text.contains("exited unexpectedly"),
        "vmctl did not say that virtiofsd died"
    );
    assert!(text.contains("degraded"), "vmctl ps does not flag the VM");
    assert!(text.contains("rm=0"), "the VM could not be removed");
    assert_eq!(
        std::fs::read_to_string(ws.join("kept.txt")).unwrap(),
        "kept\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("before.txt")).unwrap(),
        "before\n"
    );
}
