//! virtio-fs under each VMM: the same guest (kernel, the guest agent's initramfs,
//! the root image), the same virtiofsd with the same options, the same workloads,
//! booted by our VMM (`vmctl boot --fs`) and by QEMU's microvm
//! (`vhost-user-fs-device`) in turn, in the same run.
//!
//! The guest-against-host figures of [`crate::fs`] carry the whole path: FUSE in
//! the guest, virtiofsd, and, where the machine emulates hardware virtualization,
//! that emulation. Only one part of it is the VMM (its vhost-user set-up; the data
//! path is eventfds between the guest's kernel and virtiofsd), and this comparison
//! isolates it: a ratio near 1 says the rest of the gap is not ours to close.
//!
//! Neither boot has the vsock device the agent serves on, so the agent runs one
//! batch script (`vmctl.run=`) and powers off. The script runs each workload's
//! script (those of [`crate::fs`]) in the shared directory, writing its output next
//! to it on the share, and then prints [`BATCH_DONE`].

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::boot::{
    order as vmm_order, run_vm, say, shell_words, Vmm, GUEST_CMDLINE, QEMU_DEVICES, QEMU_MACHINE,
};
use crate::fs::{
    check_marker, git_setup_script, git_warmup_script, marker, parse_elapsed_ns, FsSizes, Side,
    Workload,
};
use crate::process::run_command;
use crate::report::{fmt_sig, ratio_cell, ratios, Figure, Ratio};
use crate::scan::tail;
use crate::workspace::GuestArtifacts;

/// The batch script's last line: the guest ran every workload.
pub const BATCH_DONE: &str = "VM-BENCH-FS-BATCH-DONE";
/// The guest of both VMMs: the workspace VM's size.
pub const CPUS: u32 = crate::workspace::WORKSPACE_VM.vcpus;
pub const MEMORY_MIB: u64 = crate::workspace::WORKSPACE_VM.memory_mib;
/// The share's tag in both VMMs.
const TAG: &str = "ws";
/// The batch's files, in the shared directory.
const BATCH_DIR: &str = ".batch";
/// How long virtiofsd may take to listen, and to exit once its VMM has gone.
pub(crate) const VIRTIOFSD_WAIT: Duration = Duration::from_secs(10);

/// What to compare, and with what.
#[derive(Debug, Clone)]
pub struct VmmCompare {
    pub artifacts: GuestArtifacts,
    pub qemu: PathBuf,
    pub virtiofsd: PathBuf,
    pub sizes: FsSizes,
    /// Per boot: every workload of one repetition.
    pub timeout: Duration,
    /// Where the guest drops its page cache ([`crate::fs::DROP_CACHES_FILE`]).
    pub drop_caches: PathBuf,
}

/// The figures of each VMM, with the ratios ours/QEMU.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FsVmmReport {
    /// The virtiofsd command line (socket path as `SOCKET`) and each VMM's.
    pub commands: Vec<(String, Vec<String>)>,
    pub figures: Vec<Figure>,
    pub ratios: Vec<Ratio>,
    /// A boot or a workload that failed: what and why.
    pub errors: Vec<String>,
    /// Per boot of our VMM that ran its batch: the interrupts its drivers missed and
    /// the VMM raised again (`vmm::devices::virtio::missed_interrupt`). QEMU has no
    /// such watch.
    #[serde(default)]
    pub ours_missed_interrupts: Vec<u64>,
}

impl FsVmmReport {
    /// The table of both VMMs' figures, with the ratios.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "The same workloads in a guest booted by each VMM, in turn ({CPUS} vCPUs, {MEMORY_MIB} \
             MiB; the guest agent's initramfs running one batch script per boot, the root image, \
             one virtiofsd per boot with vmctl's options): what the VMM adds to virtio-fs. \
             ours/QEMU of the medians: for MiB/s above 1 ours is faster, for seconds below 1.\n\n"
        );
        if !self.figures.is_empty() {
            s.push_str("| figure | unit | VMM | median | min | max | n | ours/QEMU |\n");
            s.push_str("|---|---|---|---:|---:|---:|---:|---:|\n");
            for f in &self.figures {
                let ratio = ratio_cell(&self.ratios, f);
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {ratio} |\n",
                    f.name,
                    f.unit,
                    f.vmm,
                    fmt_sig(f.median),
                    fmt_sig(f.min),
                    fmt_sig(f.max),
                    f.samples.len()
                ));
            }
        }
        if !self.ours_missed_interrupts.is_empty() {
            let counts: Vec<String> = self
                .ours_missed_interrupts
                .iter()
                .map(u64::to_string)
                .collect();
            s.push_str(&format!(
                "\nInterrupts a driver missed and our VMM raised again, per boot of ours: {} \
                 (QEMU's microvm has no such watch).\n",
                counts.join(", ")
            ));
        }
        for e in &self.errors {
            s.push_str(&format!(
                "\n**Error:** {} (full message in the JSON report)\n",
                e.lines().next().unwrap_or("")
            ));
        }
        s
    }
}

/// virtiofsd's options as vmctl gives them for a read-write share, the sandbox as
/// tight as this user may have it. A test in `vmctl/src/virtiofsd/daemon.rs` compares them
/// with vmctl's own.
pub fn virtiofsd_args(shared_dir: &Path, socket: &Path, root: bool) -> Vec<String> {
    let mut args: Vec<String> = vec!["--shared-dir".into(), shared_dir.display().to_string()];
    args.extend(["--socket-path".into(), socket.display().to_string()]);
    for a in [
        "--cache",
        "auto",
        "--thread-pool-size",
        "0",
        "--inode-file-handles=never",
        "--log-level",
        "warn",
        "--sandbox",
        if root { "namespace" } else { "none" },
        "--seccomp",
        "kill",
        "--modcaps=-mknod:-setfcap",
    ] {
        args.push(a.into());
    }
    args
}

/// The guest's command line, after the default console and reboot settings: the
/// agent mounts the root image and the share at its host path, then runs `batch`.
pub fn agent_cmdline(shared_dir: &Path, batch: &Path) -> String {
    use guest_agent::shares::{encode_path, CMDLINE_KEY};
    format!(
        "vmctl.root=/dev/vda {CMDLINE_KEY}={TAG}:{} {}={}",
        encode_path(shared_dir),
        guest_agent::init::RUN_KEY,
        encode_path(batch)
    )
}

/// The VMM's command line for one boot.
pub(crate) fn vmm_argv(vmm: Vmm, c: &VmmCompare, socket: &Path, cmdline: &str) -> Vec<String> {
    let a = &c.artifacts;
    let path = |p: &Path| p.display().to_string();
    let mut v: Vec<String> = Vec::new();
    match vmm {
        Vmm::Ours => {
            v.extend([
                path(&a.vmctl),
                "boot".into(),
                "--nested".into(),
                "never".into(),
            ]);
            v.extend(["--kernel".into(), path(&a.kernel)]);
            v.extend(["--initrd".into(), path(&a.agent_initramfs)]);
            v.extend(["--disk".into(), format!("{}:ro", a.rootfs.display())]);
            v.extend(["--fs".into(), format!("{TAG}:{}", socket.display())]);
            v.extend(["--cpus".into(), CPUS.to_string()]);
            v.extend(["--memory".into(), MEMORY_MIB.to_string()]);
            v.extend(["--cmdline".into(), cmdline.into()]);
        }
        Vmm::Qemu => {
            v.push(path(&c.qemu));
            // vhost-user needs the guest's memory in a shared file.
            v.extend(["-M".into(), format!("{QEMU_MACHINE},memory-backend=mem")]);
            v.extend([
                "-object".into(),
                format!("memory-backend-memfd,id=mem,size={MEMORY_MIB}M,share=on"),
            ]);
            for a in ["-enable-kvm", "-cpu", "host", "-m"] {
                v.push(a.into());
            }
            v.push(MEMORY_MIB.to_string());
            v.extend(["-smp".into(), CPUS.to_string()]);
            v.extend(QEMU_DEVICES.map(String::from));
            v.extend(["-kernel".into(), path(&a.kernel)]);
            v.extend(["-initrd".into(), path(&a.agent_initramfs)]);
            v.extend(["-append".into(), format!("{GUEST_CMDLINE} {cmdline}")]);
            v.extend([
                "-drive".into(),
                format!(
                    "id=root,file={},format=raw,if=none,readonly=on",
                    a.rootfs.display()
                ),
            ]);
            v.extend(["-device".into(), "virtio-blk-device,drive=root".into()]);
            v.extend([
                "-chardev".into(),
                format!("socket,id=fs,path={}", socket.display()),
            ]);
            v.extend([
                "-device".into(),
                format!("vhost-user-fs-device,chardev=fs,tag={TAG}"),
            ]);
        }
    }
    v
}

const VMMS: [Vmm; 2] = [Vmm::Ours, Vmm::Qemu];

/// The index of `vmm` in [`VMMS`].
fn slot(vmm: Vmm) -> usize {
    match vmm {
        Vmm::Ours => 0,
        Vmm::Qemu => 1,
    }
}

/// The steps of one boot: the untimed git warm-up, then each workload.
fn steps() -> Vec<&'static str> {
    let mut v = vec!["git_warmup"];
    v.extend(Workload::ALL.iter().map(|w| w.name()));
    v
}

/// Writes boot `boot`'s batch script and its steps' scripts into `dir`/[`BATCH_DIR`];
/// returns the batch script's path.
fn write_batch(dir: &Path, boot: usize, c: &VmmCompare) -> Result<PathBuf, String> {
    let batch_dir = dir.join(BATCH_DIR);
    fs::create_dir_all(&batch_dir).map_err(|e| format!("create {}: {e}", batch_dir.display()))?;
    let write = |name: String, text: String| {
        let path = batch_dir.join(name);
        fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))?;
        Ok::<PathBuf, String>(path)
    };
    write(
        format!("{boot}-git_warmup.sh"),
        git_warmup_script(Side::Guest),
    )?;
    for w in Workload::ALL {
        write(
            format!("{boot}-{}.sh", w.name()),
            w.script(Side::Guest, boot, &c.sizes, Some(&c.drop_caches)),
        )?;
    }
    let batch = write(
        format!("{boot}.sh"),
        format!(
            "#!/bin/bash\ncd {}\nfor step in {}; do\n  \
             bash {BATCH_DIR}/{boot}-$step.sh > {BATCH_DIR}/{boot}-$step.out 2> {BATCH_DIR}/{boot}-$step.err\n  \
             echo $? > {BATCH_DIR}/{boot}-$step.rc\ndone\necho {BATCH_DONE}\n",
            shell_words(&[dir.display().to_string()]),
            steps().join(" ")
        ),
    )?;
    fs::set_permissions(&batch, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", batch.display()))?;
    Ok(batch)
}

/// What step `step` of boot `boot` printed, once it exited 0.
fn step_output(dir: &Path, boot: usize, step: &str) -> Result<String, String> {
    let file = |ext: &str| dir.join(BATCH_DIR).join(format!("{boot}-{step}.{ext}"));
    let read = |ext: &str| fs::read_to_string(file(ext)).unwrap_or_default();
    match read("rc").trim() {
        "0" => Ok(read("out")),
        "" => Err(format!(
            "the guest did not run it ({} missing)",
            file("rc").display()
        )),
        rc => Err(format!(
            "exit status {rc}\n--- stderr (tail) ---\n{}\n--- stdout (tail) ---\n{}",
            tail(&read("err"), 2000),
            tail(&read("out"), 1000)
        )),
    }
}

/// Why git status is not measured, from the warm-up's output: a repository not clean
/// after its commit would have every timed git status re-read files.
fn unclean_repository(warmup_output: &str) -> Option<String> {
    match marker(warmup_output, "CHANGES").map(str::trim) {
        Some("0") => None,
        changes => Some(format!(
            "not measured: the git status warm-up found the freshly committed repository \
             not clean (CHANGES={})",
            changes.unwrap_or("missing")
        )),
    }
}

/// A virtiofsd serving `dir` on `socket`, its output in `log`.
struct Virtiofsd {
    child: Child,
    log: PathBuf,
}

impl Virtiofsd {
    fn start(
        program: &Path,
        args: &[String],
        socket: &Path,
        log: &Path,
    ) -> Result<Virtiofsd, String> {
        let _ = fs::remove_file(socket);
        let out = fs::File::create(log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        let mut daemon = Virtiofsd {
            child,
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + VIRTIOFSD_WAIT;
        while !socket.exists() {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                return Err(format!(
                    "virtiofsd exited ({status}) before listening: {}",
                    daemon.log_tail()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "virtiofsd did not listen on {} within {} s: {}",
                    socket.display(),
                    VIRTIOFSD_WAIT.as_secs(),
                    daemon.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    fn log_tail(&self) -> String {
        tail(&fs::read_to_string(&self.log).unwrap_or_default(), 1000).to_string()
    }
}

impl Drop for Virtiofsd {
    /// It exits when its VMM disconnects; one that does not is killed.
    fn drop(&mut self) {
        let deadline = Instant::now() + VIRTIOFSD_WAIT;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A workload's sample in one boot, or why there is none.
type Sample = Result<f64, String>;

/// What one boot measured.
struct BootResult {
    samples: Vec<(Workload, Sample)>,
    /// Our VMM's missed interrupts raised again; `None` for QEMU.
    missed_interrupts: Option<u64>,
}

/// One boot of `vmm` running repetition `boot`'s workloads: each workload's sample,
/// or why the boot as a whole failed.
fn boot_once(
    c: &VmmCompare,
    vmm: Vmm,
    boot: usize,
    dir: &Path,
    scratch: &Path,
    root: bool,
) -> Result<BootResult, String> {
    let batch = write_batch(dir, boot, c)?;
    let socket = scratch.join(format!("fs-{boot}.sock"));
    let args = virtiofsd_args(dir, &socket, root);
    let _daemon = Virtiofsd::start(
        &c.virtiofsd,
        &args,
        &socket,
        &scratch.join(format!("virtiofsd-{boot}.log")),
    )?;
    say(format!(
        "virtio-fs by VMM: boot {boot}: virtiofsd listens; {} boots the guest",
        vmm.label()
    ));
    let argv = vmm_argv(vmm, c, &socket, &agent_cmdline(dir, &batch));
    let argv: Vec<_> = argv.iter().map(Into::into).collect();
    let ran = run_vm(vmm.label(), &argv, BATCH_DONE, c.timeout, None)?;
    let missed_interrupts = match vmm {
        Vmm::Ours => Some(vmm::devices::virtio::missed_interrupt::total_in_log(
            &ran.stderr,
        )),
        Vmm::Qemu => None,
    };
    say(format!(
        "virtio-fs by VMM: boot {boot}: the guest ran the batch and stopped in {:.1} s",
        ran.to_exit.as_secs_f64()
    ));
    let warmup =
        step_output(dir, boot, "git_warmup").map_err(|e| format!("git status warm-up: {e}"))?;
    let unclean = unclean_repository(&warmup);
    let mut results: Vec<(Workload, Sample)> = Vec::new();
    for w in Workload::ALL {
        let failed = |dep: &Workload| results.iter().any(|(d, r)| d == dep && r.is_err());
        let sample = match (w.depends_on().filter(failed), &unclean) {
            (Some(dep), _) => Err(format!("not measured: {} failed", dep.name())),
            (None, Some(unclean)) if w == Workload::GitStatus => Err(unclean.clone()),
            (None, _) => step_output(dir, boot, w.name()).and_then(|out| {
                let ns = parse_elapsed_ns(&out)?;
                w.check(&out, &c.sizes)?;
                Ok(w.sample(ns, &c.sizes))
            }),
        };
        results.push((w, sample));
    }
    Ok(BootResult {
        samples: results,
        missed_interrupts,
    })
}

/// Runs the comparison in `dir` (an empty directory of its own, on the file system
/// the workspace section measures); temporary files go to `scratch`.
pub fn measure(c: &VmmCompare, dir: &Path, scratch: &Path) -> FsVmmReport {
    let root = fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let mut report = FsVmmReport::default();
    let socket = Path::new("SOCKET");
    let cmdline = agent_cmdline(dir, &dir.join(BATCH_DIR).join("N.sh"));
    let mut virtiofsd = vec![c.virtiofsd.display().to_string()];
    virtiofsd.extend(virtiofsd_args(dir, socket, root));
    report.commands = vec![
        ("virtiofsd".into(), virtiofsd),
        (
            Vmm::Ours.label().into(),
            vmm_argv(Vmm::Ours, c, socket, &cmdline),
        ),
        (
            Vmm::Qemu.label().into(),
            vmm_argv(Vmm::Qemu, c, socket, &cmdline),
        ),
    ];
    // The repository every boot's git status reads, made on the host, untimed.
    let mut setup = Command::new("bash");
    setup
        .args(["-c", &git_setup_script(c.sizes.files)])
        .current_dir(dir);
    let what = "git repository setup (host)";
    let made = run_command(setup, what, c.timeout, true).and_then(|ran| {
        check_marker(&ran, "TRACKED", c.sizes.files).map_err(|e| format!("{what}: {e}"))
    });
    if let Err(e) = made {
        report.errors.push(e);
        return report;
    }
    let mut samples: Vec<[Vec<f64>; 2]> = vec![[Vec::new(), Vec::new()]; Workload::ALL.len()];
    let mut boot = 0;
    for run in 0..c.sizes.runs {
        for vmm in vmm_order(run) {
            boot += 1;
            say(format!(
                "virtio-fs by VMM: {} boot {boot} ({} workloads)",
                vmm.label(),
                Workload::ALL.len()
            ));
            match boot_once(c, vmm, boot, dir, scratch, root) {
                Ok(result) => {
                    // In the log too: a nested host that stops later loses the report.
                    let mut line = Vec::new();
                    if let Some(missed) = result.missed_interrupts {
                        report.ours_missed_interrupts.push(missed);
                        line.push(format!("missed interrupts raised again {missed}"));
                    }
                    for (i, (w, sample)) in result.samples.into_iter().enumerate() {
                        match sample {
                            Ok(v) => {
                                line.push(format!("{} {} {}", w.name(), fmt_sig(v), w.unit()));
                                samples[i][slot(vmm)].push(v);
                            }
                            Err(e) => {
                                line.push(format!("{} failed", w.name()));
                                report.errors.push(format!(
                                    "{} boot {boot}: {}: {e}",
                                    vmm.label(),
                                    w.name()
                                ));
                            }
                        }
                    }
                    say(format!(
                        "virtio-fs by VMM: {} boot {boot}: {}",
                        vmm.label(),
                        line.join(", ")
                    ));
                }
                Err(e) => {
                    say(format!(
                        "virtio-fs by VMM: {} boot {boot} failed: {}",
                        vmm.label(),
                        e.lines().next().unwrap_or("")
                    ));
                    report
                        .errors
                        .push(format!("{} boot {boot}: {e}", vmm.label()));
                }
            }
        }
    }
    for (w, pair) in Workload::ALL.iter().zip(samples) {
        for (vmm, s) in VMMS.into_iter().zip(pair) {
            report
                .figures
                .extend(Figure::new(w.name(), w.unit(), vmm.label(), s));
        }
    }
    report.ratios = ratios(&report.figures);
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::TempDir;

    fn executable(path: &Path, text: &str) {
        fs::write(path, text).unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A comparison whose "VMMs" run the batch on this machine (with `fail-qemu` in
    /// `dir`, QEMU's exits 1 at once; ours says it raised 3 missed interrupts again)
    /// and whose "virtiofsd" only makes its socket.
    fn fake_compare(dir: &Path) -> VmmCompare {
        let (vmm, qemu, virtiofsd) = (dir.join("vmm"), dir.join("qemu"), dir.join("virtiofsd"));
        executable(
            &vmm,
            &format!(
                "#!/bin/bash\n[ \"$(basename \"$0\")\" = qemu ] && [ -e {fail} ] && exit 1\n\
                 for a in \"$@\"; do case \"$a\" in *{key}=*) p=${{a##*{key}=}}; p=${{p%% *}};; esac; done\n\
                 \"$p\" || exit\n\
                 [ \"$(basename \"$0\")\" = vmm ] && echo 'WARN {missed}' >&2\n\
                 exit 0\n",
                fail = dir.join("fail-qemu").display(),
                key = guest_agent::init::RUN_KEY,
                missed = vmm::devices::virtio::missed_interrupt::summary(1, 3),
            ),
        );
        fs::hard_link(&vmm, &qemu).unwrap();
        executable(
            &virtiofsd,
            "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --socket-path ] && touch \"$2\"; shift; done\n",
        );
        VmmCompare {
            artifacts: GuestArtifacts {
                vmctl: vmm,
                kernel: "/k".into(),
                agent_initramfs: "/a".into(),
                rootfs: "/r".into(),
            },
            qemu,
            virtiofsd,
            sizes: FsSizes {
                file_mib: 1,
                files: 10,
                runs: 1,
                edit_rounds: 1,
                origin: "test".into(),
                judged: false,
            },
            timeout: Duration::from_secs(60),
            drop_caches: dir.join("drop_caches"),
        }
    }

    fn scratch(name: &str) -> (TempDir, PathBuf) {
        let tmp = TempDir::unique(name);
        let ws = tmp.0.join("ws");
        fs::create_dir_all(&ws).unwrap();
        (tmp, ws)
    }

    #[test]
    fn both_vmms_run_every_workload() {
        let (tmp, ws) = scratch("-fs-vmm-test");
        let r = measure(&fake_compare(&tmp.0), &ws, &tmp.0);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(r.figures.len(), 2 * Workload::ALL.len());
        assert!(r
            .figures
            .iter()
            .all(|f| f.samples.len() == 1 && f.median > 0.0));
        assert_eq!(r.ratios.len(), Workload::ALL.len());
        let labels: Vec<_> = r.commands.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels, ["virtiofsd", "vmctl", "qemu-microvm"]);
        assert_eq!(r.ours_missed_interrupts, [3]);
        let md = r.markdown();
        assert!(md.contains("raised again, per boot of ours: 3 "), "{md}");
        assert!(md.contains("| fs_git_status_s | s | vmctl |"), "{md}");
        assert!(
            md.contains("| fs_git_status_s | s | qemu-microvm |"),
            "{md}"
        );
        // Each boot dropped the guest's caches once, before its read.
        assert_eq!(
            fs::read_to_string(tmp.0.join("drop_caches")).unwrap(),
            "3\n"
        );
    }

    #[test]
    fn a_failed_boot_and_a_failed_workload_are_errors() {
        let (tmp, ws) = scratch("-fs-vmm-test-fail");
        let c = fake_compare(&tmp.0);
        fs::write(tmp.0.join("fail-qemu"), "").unwrap();
        // Boot 1 (ours) cannot make its directory of small files.
        fs::write(ws.join("small-guest-1"), "").unwrap();
        let r = measure(&c, &ws, &tmp.0);
        let has = |needle: &str| r.errors.iter().any(|e| e.contains(needle));
        assert!(has("qemu-microvm boot 2: qemu-microvm: "), "{:?}", r.errors);
        assert!(
            has("vmctl boot 1: fs_create_files_s: exit status 1"),
            "{:?}",
            r.errors
        );
        assert!(
            has("vmctl boot 1: fs_stat_files_s: not measured: fs_create_files_s failed"),
            "{:?}",
            r.errors
        );
        assert!(r.figures.iter().all(|f| f.vmm == "vmctl"));
        assert!(r.figures.iter().any(|f| f.name == "fs_git_status_s"));
        assert!(!r.figures.iter().any(|f| f.name == "fs_create_files_s"));
        assert!(r.ratios.is_empty());
        assert!(r.markdown().contains("**Error:** qemu-microvm boot 2"));
    }

    #[test]
    fn an_unclean_repository_is_not_timed() {
        assert_eq!(unclean_repository("INDEX=x\nCHANGES=0\n"), None);
        let unclean = unclean_repository("CHANGES=3\n").unwrap();
        assert!(unclean.contains("CHANGES=3"), "{unclean}");
        assert!(unclean_repository("").unwrap().contains("CHANGES=missing"));
    }

    #[test]
    fn the_guest_is_told_its_share_and_batch() {
        let line = agent_cmdline(Path::new("/tmp/my ws"), Path::new("/tmp/my ws/.batch/1.sh"));
        assert_eq!(
            line,
            "vmctl.root=/dev/vda vmctl.share=ws:/tmp/my%20ws vmctl.run=/tmp/my%20ws/.batch/1.sh"
        );
        let (cfg, warnings) = guest_agent::init::parse_cmdline(&line);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            cfg.run.as_deref(),
            Some(Path::new("/tmp/my ws/.batch/1.sh"))
        );
        assert_eq!(cfg.shares[0].path, Path::new("/tmp/my ws"));
    }
}
