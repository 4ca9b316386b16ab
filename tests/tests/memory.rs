//! Free page reporting: memory the guest frees, and the caches an idle guest drops, go
//! back to the host, as `vmctl ps` shows it (HELD: the memory the VM's processes hold
//! on the host; in the nested host, QEMU's, which the nested host's own free page
//! reporting gives back).

use std::time::{Duration, Instant};

use vm_tests::{assert_ok, stdout, Workspace};

/// What the guest fills and then frees: most of its 1 GiB.
const FILL_MIB: u64 = 640;
/// How much of it must be back on the host: the guest reports free 2 MiB blocks only,
/// and keeps some free memory unreported (its low watermark and one batch).
const BACK_MIB: u64 = FILL_MIB / 2;
/// The guest reports a batch every 2 s, a share of its free memory at a time; in the
/// nested host a second guest (the nested host's kernel) does the same after it.
const BACK_WITHIN: Duration = Duration::from_secs(180);

#[test]
fn memory_the_guest_frees_goes_back_to_the_host() {
    vm_tests::vm_scenario(
        "memory::memory_the_guest_frees_goes_back_to_the_host",
        freed_memory_scenario,
    );
}

/// What the guest reads through the workspace's share stays in its page cache until
/// the guest has gone `drop_caches_after_idle_s` without a command, or a program left
/// running at work; then it drops its caches, free page reporting gives the memory
/// back (HELD falls), and its console says so.
#[test]
fn an_idle_guests_caches_go_back_to_the_host() {
    vm_tests::vm_scenario(
        "memory::an_idle_guests_caches_go_back_to_the_host",
        idle_caches_scenario,
    );
}

/// `free_page_reporting = false` in a workspace's section of the config: its VM has
/// no balloon (virtio device 5) among its virtio devices.
#[test]
fn a_workspace_can_keep_its_memory() {
    vm_tests::vm_scenario(
        "memory::a_workspace_can_keep_its_memory",
        kept_memory_scenario,
    );
}

fn kept_memory_scenario() {
    let keeps = Workspace::new("memory-kept");
    keeps.write_config(&format!(
        "[workspaces.{:?}]\nfree_page_reporting = false\n",
        keeps.path().canonicalize().expect("the workspace's path")
    ));
    let devices = keeps
        .exec("cat /sys/bus/virtio/devices/*/device | sort | uniq -c | awk '{print $2 \"=\" $1}'");
    assert_ok(&devices, "listing the VM's virtio devices");
    let devices = stdout(&devices);
    assert!(
        devices.contains("0x0013="),
        "no vsock among the VM's virtio devices: the listing is wrong\n{devices}"
    );
    assert!(
        !devices.contains("0x0005="),
        "a VM whose workspace set free_page_reporting = false has a balloon\n{devices}"
    );
}

fn freed_memory_scenario() {
    let ws = Workspace::new("memory-back");
    ws.write_config("memory_percent = 0\nmemory_min_mib = 1024\n");
    assert_ok(&ws.run(&["up"]), "vmctl up");
    let idle = held_mib(&ws);

    // A tmpfs of the guest's own holds the memory until the test lets it go.
    let fill = format!(
        "mkdir -p /run/fill && mount -t tmpfs -o size={}M fill /run/fill && \
         head -c {FILL_MIB}M /dev/zero > /run/fill/zeros",
        FILL_MIB + 16
    );
    assert_ok(&ws.exec_as_root(&fill), "filling the guest's memory");
    let full = held_mib(&ws);
    assert!(
        full >= idle + FILL_MIB / 2,
        "the VM held {idle} MiB idle and {full} MiB with {FILL_MIB} MiB filled: the \
         measure does not see the guest's memory"
    );

    assert_ok(
        &ws.exec_as_root("rm /run/fill/zeros && umount /run/fill"),
        "freeing the guest's memory",
    );
    let freed_at = Instant::now();
    let mut held = full;
    while full.saturating_sub(held) < BACK_MIB {
        assert!(
            freed_at.elapsed() < BACK_WITHIN,
            "{BACK_WITHIN:?} after the guest freed {FILL_MIB} MiB, the VM still holds \
             {held} MiB on the host ({full} MiB full, {idle} MiB idle): less than \
             {BACK_MIB} MiB came back"
        );
        std::thread::sleep(Duration::from_secs(2));
        held = held_mib(&ws);
    }
    eprintln!(
        "held {idle} MiB idle, {full} MiB with {FILL_MIB} MiB filled, {held} MiB {:.0?} \
         after the guest freed it",
        freed_at.elapsed()
    );
}

/// What the guest reads through the share into its page cache.
const READ_MIB: u64 = 384;
/// The idle time the test's config sets: long enough to read HELD with the cache full
/// after the reading command.
const IDLE_S: u64 = 20;
/// How long a program the test leaves running in the guest keeps a CPU busy after
/// the read: past the idle time and the agent's next look (5 s), with room to see
/// that the caches stayed.
const BUSY_S: u64 = IDLE_S + 15;

fn idle_caches_scenario() {
    let ws = Workspace::new("memory-idle");
    ws.write_config(&format!(
        "memory_percent = 0\nmemory_min_mib = 1024\ndrop_caches_after_idle_s = {IDLE_S}\n"
    ));
    let file = ws.path().join("read-me.bin");
    let block: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    let mut out = std::fs::File::create(&file).expect("creating the file to read");
    for _ in 0..READ_MIB {
        std::io::Write::write_all(&mut out, &block).expect("writing the file to read");
    }
    drop(out);
    assert_ok(&ws.run(&["up"]), "vmctl up");
    let idle = held_mib(&ws);
    let read = ws.exec(&format!("cat -- '{}' > /dev/null", file.display()));
    assert_ok(&read, "reading the file in the guest");
    let read_at = Instant::now();
    // No command of the agent's runs while this does: `nohup`, as one leaves a build
    // or a dev server running.
    let busy = ws.exec(&format!(
        "nohup timeout {BUSY_S} sh -c 'while :; do :; done' > /dev/null 2>&1 &"
    ));
    assert_ok(&busy, "leaving a busy program running in the guest");
    let full = held_mib(&ws);
    assert!(
        full >= idle + READ_MIB / 2,
        "the VM held {idle} MiB idle and {full} MiB after the guest read {READ_MIB} MiB: \
         the guest does not cache what it reads, or the measure does not see it"
    );
    // Without the busy program the caches would go IDLE_S after the read, at the
    // agent's first look past it.
    std::thread::sleep(Duration::from_secs(IDLE_S + 10).saturating_sub(read_at.elapsed()));
    let console = stdout(&ws.run(&["logs"]));
    assert!(
        !console.contains("dropped the guest's caches"),
        "{:?} after the read, with a program at work in the guest all along, its caches \
         went\n{console}",
        read_at.elapsed()
    );
    let mut held = full;
    while full.saturating_sub(held) < READ_MIB / 2 {
        assert!(
            read_at.elapsed() < BACK_WITHIN + Duration::from_secs(BUSY_S + IDLE_S),
            "{:?} after the guest read {READ_MIB} MiB and went idle {BUSY_S} s later \
             ({IDLE_S} s to drop its caches), the VM still holds {held} MiB ({full} MiB \
             after the read, {idle} MiB before)\n{}",
            read_at.elapsed(),
            stdout(&ws.run(&["logs", "-n", "20"]))
        );
        std::thread::sleep(Duration::from_secs(2));
        held = held_mib(&ws);
    }
    let console = stdout(&ws.run(&["logs"]));
    assert!(
        console.contains(&format!("idle for {IDLE_S} s: dropped the guest's caches")),
        "the console does not say the caches went\n{console}"
    );
    eprintln!(
        "held {idle} MiB idle, {full} MiB after reading {READ_MIB} MiB, {held} MiB {:.0?} \
         after the read",
        read_at.elapsed()
    );
}

/// The host memory the workspace's VM holds, in MiB (`vmctl ps`'s HELD).
fn held_mib(ws: &Workspace) -> u64 {
    let row = ws.ps_row();
    row.held_mib
        .unwrap_or_else(|| panic!("vmctl ps gives no memory held by the VM: {row:?}"))
}
