//! Shared helpers for the end-to-end tests in `tests/tests/*.rs`, which run the real
//! `vmctl` binary against the real guest kernel and initramfs.
//!
//! Inputs, each from an environment variable or built on first use (once per test
//! process):
//! - `VMCTL_BIN`: the `vmctl` binary; else `cargo build --release -p vmctl` into this
//!   workspace's target directory.
//! - `VMCTL_KERNEL`: the guest `vmlinux`; else `kernel-config/build.sh guest` (cached; the
//!   first build takes minutes).
//! - `VMCTL_INITRAMFS`: the base initramfs; else `rootfs/build-initramfs.sh`.
//!
//! `VMCTL_VM_TIMEOUT` (seconds, default 300) bounds each VM run.
//!
//! Skipping: a test that boots a VM first calls [`vm_available`]. Where `vmctl` cannot
//! boot a guest (no hardware KVM and no `qemu-system-x86_64` for the nested host), it
//! prints `SKIPPED VM TEST <name>: <reason>` on stderr, appends the same line to the
//! skip file (`VMCTL_SKIP_FILE`, default `<target>/vm-tests-skipped.txt`, which
//! `scripts/test.sh` truncates and summarizes) and returns `false`. With
//! `VMCTL_REQUIRE_VM=1` it panics instead.

pub mod hang_report;
pub mod host_user;
pub mod ps;
pub mod upstream;
pub mod watchdog;

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a VM may run before the test kills it: `VMCTL_VM_TIMEOUT` seconds, default
/// 300. The nested host is slow (~10 s per boot, more when tests run in parallel or the
/// machine is busy).
pub fn vm_timeout() -> Duration {
    let secs = std::env::var("VMCTL_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok());
    Duration::from_secs(secs.unwrap_or(300))
}

/// How long `vmctl` may take to reject bad input (validated before any VM starts).
pub const BAD_INPUT_TIMEOUT: Duration = Duration::from_secs(60);

/// Memory given to test VMs: the nested host is slow with more.
pub const TEST_MEMORY_MIB: u32 = 256;

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Cargo's target directory: found from the running test executable
/// (`<target>/[<triple>/]<profile>/deps/<test>`), which honours `CARGO_TARGET_DIR` and
/// `.cargo/config` alike; falls back to `CARGO_TARGET_DIR` or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1) {
            if dir.join("CACHEDIR.TAG").is_file() {
                return dir.to_path_buf();
            }
        }
    }
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if Path::new(&dir).is_absolute() => PathBuf::from(dir),
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

pub(crate) fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Whether VM tests must run here (`VMCTL_REQUIRE_VM` set to 1, true or yes): a VM
/// test that cannot then fails instead of being skipped.
pub fn vms_required() -> bool {
    env_flag("VMCTL_REQUIRE_VM")
}

fn env_flag(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref(),
        Ok("1") | Ok("true") | Ok("yes")
    )
}

/// The `vmctl` binary: `VMCTL_BIN`, else built once per test process with
/// `cargo build --release -p vmctl`.
pub fn vmctl_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = env_path("VMCTL_BIN") {
            assert!(bin.is_file(), "VMCTL_BIN={} does not exist", bin.display());
            return bin;
        }
        let target = target_dir();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        eprintln!("vm-tests: building vmctl (cargo build --release -p vmctl)");
        let status = Command::new(&cargo)
            .args([
                "build",
                "--release",
                "--quiet",
                "-p",
                "vmctl",
                "--target-dir",
            ])
            .arg(&target)
            .current_dir(workspace_root())
            .stdin(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cargo));
        assert!(
            status.success(),
            "cargo build --release -p vmctl failed ({status})"
        );
        let bin = target.join("release").join("vmctl");
        assert!(bin.is_file(), "{} missing after building it", bin.display());
        bin
    })
}

/// Runs one of the repository's build scripts, which print the artifact path as the
/// last line of their stdout and progress on stderr (passed through). The benchmark
/// calls this too; the tests' own `build_artifact` panics where it returns an error.
pub fn try_build_artifact(script: &str, args: &[&str]) -> Result<PathBuf, String> {
    let path = workspace_root().join(script);
    let out = Command::new(&path)
        .args(args)
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", path.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{script} {} failed ({}); run scripts/setup.sh first",
            args.join(" "),
            out.status
        ));
    }
    let printed = String::from_utf8_lossy(&out.stdout);
    let last = printed
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let artifact = PathBuf::from(last);
    if !artifact.is_file() {
        return Err(format!("{script} printed {last:?}, which is not a file"));
    }
    Ok(artifact)
}

pub(crate) fn build_artifact(script: &str, args: &[&str]) -> PathBuf {
    eprintln!("vm-tests: running {script} {args:?} (cached after the first build)");
    try_build_artifact(script, args).unwrap_or_else(|e| panic!("{e}"))
}

/// The guest kernel: `VMCTL_KERNEL`, else `kernel-config/build.sh guest`.
pub fn kernel() -> &'static Path {
    static KERNEL: OnceLock<PathBuf> = OnceLock::new();
    KERNEL.get_or_init(|| match env_path("VMCTL_KERNEL") {
        Some(k) => {
            assert!(k.is_file(), "VMCTL_KERNEL={} does not exist", k.display());
            k
        }
        None => build_artifact("kernel-config/build.sh", &["guest"]),
    })
}

/// The base test/hello initramfs: `VMCTL_INITRAMFS`, else `rootfs/build-initramfs.sh`.
pub fn base_initramfs() -> &'static Path {
    static INITRAMFS: OnceLock<PathBuf> = OnceLock::new();
    INITRAMFS.get_or_init(|| match env_path("VMCTL_INITRAMFS") {
        Some(i) => {
            assert!(
                i.is_file(),
                "VMCTL_INITRAMFS={} does not exist",
                i.display()
            );
            i
        }
        None => build_artifact("rootfs/build-initramfs.sh", &[]),
    })
}

/// Where skipped tests are recorded (`VMCTL_SKIP_FILE`, default
/// `<target>/vm-tests-skipped.txt`).
pub fn skip_file() -> PathBuf {
    env_path("VMCTL_SKIP_FILE").unwrap_or_else(|| target_dir().join("vm-tests-skipped.txt"))
}

/// Records a skipped test: a loud line on stderr and one in the skip file.
pub fn record_skip(test: &str, reason: &str) {
    say_and_record(
        &skip_file(),
        &format!("SKIPPED VM TEST {test}: {reason}"),
        "skip",
    );
}

/// `line`, loud on stderr and appended to `file`, for `scripts/test.sh` to count.
fn say_and_record(file: &Path, line: &str, what: &str) {
    // Straight to the process's stderr: libtest captures eprintln! of passing tests.
    let _ = writeln!(std::io::stderr(), "\n!!!!!!!! {line}\n");
    append_line(file, line, what);
}

/// Where checks left out of tests that ran are recorded (`VMCTL_PARTIAL_FILE`, default
/// `<target>/vm-tests-partial.txt`), for `scripts/test.sh` to list: a check this
/// machine cannot make (only root can make another user's file) is not a skipped VM
/// test, which `VMCTL_REQUIRE_VM=1` refuses, but must not pass unsaid either.
pub fn partial_file() -> PathBuf {
    env_path("VMCTL_PARTIAL_FILE").unwrap_or_else(|| target_dir().join("vm-tests-partial.txt"))
}

/// Records a check a running test leaves out: a loud line on stderr and one in the
/// partial file.
pub fn record_check_not_made(check: &str, reason: &str) {
    say_and_record(
        &partial_file(),
        &format!("CHECK NOT MADE {check}: {reason}"),
        "left-out check",
    );
}

/// For unit tests of the workspace's crates that need what only some machines have
/// (root, a program): says, past libtest's capture, that `test` checked nothing here
/// for want of it (`why`), or fails it under CI (`CI` set, as `.ci/run` sets it),
/// whose machines have it: there a test that cannot run is a broken machine, not a
/// pass.
pub fn not_run(test: &str, why: &str) {
    if let Some(ci) = ci() {
        panic!("{test} did not run, which it must under CI (CI={ci}): {why}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: {test}: {why}; it passes here unchecked (with CI set it fails)"
    );
}

/// `CI`'s value when it says this is a CI run (set, not empty, "0" or "false").
fn ci() -> Option<String> {
    std::env::var("CI")
        .ok()
        .filter(|ci| !ci.is_empty() && ci != "0" && ci != "false")
}

/// Where the lost wake-ups the VMMs of the tests' VMs made up for are recorded
/// (`VMCTL_WAKEUP_FILE`, default `<target>/vm-tests-wakeups.txt`), for
/// `scripts/test.sh` to count: how often the nested host (or a bug of ours) loses an
/// interrupt or a notification, which the tests would not otherwise see.
pub fn wakeup_file() -> PathBuf {
    env_path("VMCTL_WAKEUP_FILE").unwrap_or_else(|| target_dir().join("vm-tests-wakeups.txt"))
}

/// The lines of a VMM's log in which it made up for a lost wake-up.
fn made_up_wakeups(log: &str) -> impl Iterator<Item = &str> {
    use vmm::devices::virtio::{missed_interrupt, missed_notification};
    log.lines().filter(|line| {
        line.contains(missed_interrupt::LOG_MARK) || line.contains(missed_notification::LOG_MARK)
    })
}

/// Records each line of `log` in which a VMM made up for a lost wake-up in
/// [`wakeup_file`], for `scripts/test.sh` to list; `whose` names the VM.
fn record_made_up_wakeups(log: &str, whose: &str) {
    for line in made_up_wakeups(log) {
        append_line(
            &wakeup_file(),
            &format!("LOST WAKE-UP MADE UP FOR in {whose}: {}", line.trim()),
            "lost wake-up",
        );
    }
}

/// Where retried scenarios are recorded (`VMCTL_RETRY_FILE`, default
/// `<target>/vm-tests-retried.txt`), for `scripts/test.sh` to count.
pub fn retry_file() -> PathBuf {
    env_path("VMCTL_RETRY_FILE").unwrap_or_else(|| target_dir().join("vm-tests-retried.txt"))
}

fn append_line(file: &Path, line: &str, what: &str) {
    if let Some(dir) = file.parent() {
        let _ = fs::create_dir_all(dir);
    }
    // One write per line: appends from parallel tests do not interleave.
    match OpenOptions::new().create(true).append(true).open(file) {
        Ok(mut f) => {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
        Err(e) => eprintln!(
            "vm-tests: cannot record the {what} in {}: {e}",
            file.display()
        ),
    }
}

/// Why `vmctl` cannot boot a guest on this machine, or `None` if it can: it needs
/// hardware KVM (`kvm_intel`/`kvm_amd`) or QEMU for the nested host.
pub fn vm_unavailable_reason() -> Option<String> {
    if hardware_kvm() {
        return None;
    }
    let qemu = env_path("VMCTL_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    if find_executable(&qemu).is_some() {
        return None;
    }
    Some(format!(
        "no hardware KVM (kvm_intel/kvm_amd not loaded) and no {} for the nested host \
         (apt-get install qemu-system-x86, or run scripts/setup.sh)",
        qemu.display()
    ))
}

/// Call first in a test that needs the nested host (QEMU), whatever this host's KVM
/// is: `true` if QEMU is here; otherwise the skip is recorded (or, with
/// `VMCTL_REQUIRE_VM=1`, the test panics).
pub fn nested_host_available(test: &str) -> bool {
    let qemu = env_path("VMCTL_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    if find_executable(&qemu).is_some() {
        return true;
    }
    let reason = format!(
        "no {} for the nested host (apt-get install qemu-system-x86)",
        qemu.display()
    );
    if vms_required() {
        panic!("VMCTL_REQUIRE_VM=1 but {test} cannot run: {reason}");
    }
    record_skip(test, &reason);
    false
}

/// Whether VMs run directly on this host's KVM (hardware-backed), not in the nested host.
pub fn hardware_kvm() -> bool {
    let loaded = ["/sys/module/kvm_intel", "/sys/module/kvm_amd"]
        .iter()
        .any(|m| Path::new(m).exists());
    loaded && Path::new("/dev/kvm").exists()
}

/// Call first in every test that boots a VM: `true` if it can run here; otherwise
/// records the skip and returns `false` (the test then returns), or panics when
/// `VMCTL_REQUIRE_VM=1`.
pub fn vm_available(test: &str) -> bool {
    match vm_unavailable_reason() {
        None => true,
        Some(reason) if vms_required() => {
            panic!("VMCTL_REQUIRE_VM=1 but VM test {test} cannot run: {reason}")
        }
        Some(reason) => {
            record_skip(test, &reason);
            false
        }
    }
}

/// Looks a program up like the shell does (a path with a slash is taken as is).
pub fn find_executable(program: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if program.components().count() > 1 {
        return executable(program).then(|| program.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

/// A temporary directory removed on drop (kept if `VMCTL_KEEP_TEMP=1`).
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "vm-tests-{label}-{}-{n}-{}",
            std::process::id(),
            unique_suffix()
        ));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if env_flag("VMCTL_KEEP_TEMP") {
            eprintln!("vm-tests: keeping {}", self.0.display());
        } else {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

fn unique_suffix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// `len` random bytes from the kernel.
pub fn random_bytes(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("read /dev/urandom");
    buf
}

/// A random lowercase hex string of `len` characters (safe to embed in shell scripts).
pub fn random_hex(len: usize) -> String {
    random_bytes(len.div_ceil(2))
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()[..len]
        .to_string()
}

/// One file of a newc cpio archive.
pub struct CpioEntry<'a> {
    /// Path inside the archive, without a leading slash (`etc/vmtest.sh`).
    pub path: &'a str,
    /// Full mode, type bits included (`0o100755` file, `0o040755` directory).
    pub mode: u32,
    pub data: &'a [u8],
}

/// Writes an uncompressed newc ("070701") cpio archive, trailer included, as the
/// kernel's initramfs unpacker reads it.
pub fn newc_archive(entries: &[CpioEntry]) -> Vec<u8> {
    fn pad4(out: &mut Vec<u8>) {
        while !out.len().is_multiple_of(4) {
            out.push(0);
        }
    }
    fn entry(out: &mut Vec<u8>, ino: u32, path: &str, mode: u32, nlink: u32, data: &[u8]) {
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            size = data.len(),
            devmajor = 0,
            devminor = 0,
            rdevmajor = 0,
            rdevminor = 0,
            namesize = path.len() + 1,
            check = 0,
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(path.as_bytes());
        out.push(0);
        pad4(out);
        out.extend_from_slice(data);
        pad4(out);
    }
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let nlink = if e.mode & 0o170000 == 0o040000 { 2 } else { 1 };
        entry(&mut out, 1000 + i as u32, e.path, e.mode, nlink, e.data);
    }
    entry(&mut out, 0, "TRAILER!!!", 0, 1, &[]);
    out
}

/// `base` (a gzip'd initramfs) followed by an archive holding `/etc/vmtest.sh` =
/// `script`, which the guest's `/init` runs with `sh` before it reboots.
pub fn initramfs_with_script(base: &[u8], script: &str) -> Vec<u8> {
    initramfs_with(
        base,
        &[
            CpioEntry {
                path: "etc",
                mode: 0o040755,
                data: &[],
            },
            CpioEntry {
                path: "etc/vmtest.sh",
                mode: 0o100755,
                data: script.as_bytes(),
            },
        ],
    )
}

/// `base` (a gzip'd initramfs) followed by an archive of `entries`, which add to or
/// replace the base's files. The kernel unpacks concatenated archives; an
/// uncompressed one must start 4-byte aligned, hence the zero padding (which the
/// kernel skips).
pub fn initramfs_with(base: &[u8], entries: &[CpioEntry]) -> Vec<u8> {
    let mut image = base.to_vec();
    image.resize(image.len().next_multiple_of(512), 0);
    image.extend_from_slice(&newc_archive(entries));
    image
}

/// Writes `dir/initramfs.cpio.gz`: the base initramfs with `script` appended (see
/// [`initramfs_with_script`]).
pub fn test_initramfs(dir: &TempDir, script: &str) -> PathBuf {
    let base = fs::read(base_initramfs())
        .unwrap_or_else(|e| panic!("read {}: {e}", base_initramfs().display()));
    let path = dir.join("initramfs.cpio.gz");
    fs::write(&path, initramfs_with_script(&base, script))
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// What a `vmctl` run produced.
#[derive(Debug)]
pub struct Run {
    pub args: Vec<OsString>,
    /// Exit code; `None` if killed by a signal (or by the timeout).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub elapsed: Duration,
}

impl Run {
    /// Everything about the run, for assertion messages.
    pub fn report(&self) -> String {
        format!(
            "vmctl {:?}\nexit code: {:?}{}, {:.1} s\n--- stdout ---\n{}\n--- stderr ---\n{}\n--------------",
            self.args,
            self.code,
            if self.timed_out { " (KILLED: timed out)" } else { "" },
            self.elapsed.as_secs_f64(),
            self.stdout.trim_end(),
            self.stderr.trim_end()
        )
    }

    /// Asserts the guest ran to its reboot and `vmctl` exited 0.
    pub fn assert_success(&self) {
        assert!(!self.timed_out, "vmctl timed out\n{}", self.report());
        assert_eq!(self.code, Some(0), "vmctl failed\n{}", self.report());
        assert_no_panic(self);
    }
}

/// Asserts that `vmctl` did not panic or print a backtrace.
pub fn assert_no_panic(run: &Run) {
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(
            !run.stderr.contains(bad),
            "vmctl stderr contains {bad:?}\n{}",
            run.report()
        );
    }
}

/// A `vmctl` invocation.
pub struct Vmctl {
    program: Option<PathBuf>,
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
    timeout: Duration,
    wrapper: Vec<OsString>,
}

impl Vmctl {
    /// `vmctl <args>` with the default VM timeout.
    pub fn new() -> Vmctl {
        Vmctl {
            program: None,
            args: Vec::new(),
            envs: Vec::new(),
            timeout: vm_timeout(),
            wrapper: Vec::new(),
        }
    }

    /// `vmctl boot --kernel <kernel> --initrd <initrd> --memory 256`.
    pub fn boot(initrd: &Path) -> Vmctl {
        let mut v = Vmctl::new();
        v.arg("boot")
            .arg("--kernel")
            .arg(kernel())
            .arg("--initrd")
            .arg(initrd);
        v.arg("--memory").arg(TEST_MEMORY_MIB.to_string());
        v
    }

    /// Runs another `vmctl` binary (e.g. a copy readable by another user).
    pub fn program(&mut self, program: impl AsRef<Path>) -> &mut Vmctl {
        self.program = Some(program.as_ref().to_path_buf());
        self
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Vmctl {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, args: I) -> &mut Vmctl {
        for a in args {
            self.arg(a);
        }
        self
    }

    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Vmctl {
        self.envs
            .push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    pub fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut Vmctl {
        self.envs.push((key.as_ref().to_owned(), None));
        self
    }

    pub fn timeout(&mut self, timeout: Duration) -> &mut Vmctl {
        self.timeout = timeout;
        self
    }

    /// Runs `vmctl` through a wrapper command (e.g. `setpriv ...`).
    pub fn wrapper<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, cmd: I) -> &mut Vmctl {
        self.wrapper = cmd.into_iter().map(|s| s.as_ref().to_owned()).collect();
        self
    }

    /// Runs it to completion (killing it after the timeout), capturing everything.
    pub fn run(&self) -> Run {
        let program = self.program.as_deref().unwrap_or_else(|| vmctl_bin());
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(program);
                c
            }
            None => Command::new(program),
        };
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &self.envs {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        // Its own process group, so a timeout can kill vmctl's children (QEMU) too.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
        let pid = child.id();
        let pipes = Pipes::read(&mut child);
        let mut timed_out = false;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for vmctl") {
                break status;
            }
            if start.elapsed() > self.timeout {
                timed_out = true;
                kill_tree(pid);
                break child.wait().expect("wait for vmctl");
            }
            thread::sleep(Duration::from_millis(20));
        };
        let elapsed = start.elapsed();
        // Children left behind (by a crash, or by a timeout kill that missed one) may
        // still hold the pipes: give them a moment, then take what was read so far.
        if !pipes.ended_within_grace() {
            kill_tree(pid);
        }
        let mut args = self.wrapper.clone();
        args.extend(self.args.iter().cloned());
        let run = Run {
            args,
            code: status.code(),
            stdout: pipes.out.text(),
            stderr: pipes.err.text(),
            timed_out,
            elapsed,
        };
        // A VM of `vmctl boot` logs on vmctl's stderr; a workspace VM's supervisor log
        // is read by its `Workspace`.
        record_made_up_wakeups(&run.stderr, &format!("vmctl {:?}", run.args));
        run
    }
}

/// How long a command's stdout and stderr may stay open after it exited: what holds
/// them longer is a process it left behind, which inherited them.
const PIPES_GRACE: Duration = Duration::from_secs(5);

/// A child's stdout and stderr, each read to its end by a thread of its own.
pub(crate) struct Pipes {
    out: Capture,
    err: Capture,
    /// The pipes' inodes, to name what holds them.
    inodes: Vec<u64>,
}

impl Pipes {
    /// Starts reading `child`'s stdout and stderr (one not piped reads as empty).
    pub(crate) fn read(child: &mut Child) -> Pipes {
        let inodes = [
            child.stdout.as_ref().and_then(pipe_inode),
            child.stderr.as_ref().and_then(pipe_inode),
        ]
        .into_iter()
        .flatten()
        .collect();
        Pipes {
            out: Capture::start(child.stdout.take()),
            err: Capture::start(child.stderr.take()),
            inodes,
        }
    }

    fn ended(&self) -> bool {
        self.out.done() && self.err.done()
    }

    /// Once the child exited: waits at most [`PIPES_GRACE`] for both pipes to end, and
    /// says whether they did.
    pub(crate) fn ended_within_grace(&self) -> bool {
        let deadline = Instant::now() + PIPES_GRACE;
        while !self.ended() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        self.ended()
    }

    /// The output of `what`, which exited with `status`, once both its pipes ended;
    /// panics when a process still holds them [`PIPES_GRACE`] later, naming it and the
    /// pipes as `whose` ("vmctl's"). Without this bound such a process (a daemon that
    /// kept them) would hang the test for good, as it hangs `out=$(vmctl up)`.
    pub(crate) fn output(self, status: ExitStatus, what: &str, whose: &str) -> Output {
        if !self.ended_within_grace() {
            let holders = pipe_holders(&self.inodes);
            // What was read goes to the test's log, not into the failure: the guest's
            // words there must not pass for a lost VM.
            eprintln!(
                "{what} printed, before a process kept its pipes:\n--- stdout ---\n{}\n\
                 --- stderr ---\n{}",
                self.out.text(),
                self.err.text()
            );
            panic!(
                "{PIPES_GRACE:?} after {what} exited ({status}), a process still holds \
                 {whose} stdout/stderr: {}; one it left behind inherited them, and a caller \
                 reading them to their end (`out=$(vmctl up)`) never returns",
                if holders.is_empty() {
                    "(which one was not found in /proc)".to_string()
                } else {
                    holders.join(", ")
                }
            );
        }
        Output {
            status,
            stdout: self.out.bytes(),
            stderr: self.err.bytes(),
        }
    }
}

/// The inode of the pipe `pipe` is an end of.
fn pipe_inode(pipe: &impl std::os::fd::AsRawFd) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(format!("/proc/self/fd/{}", pipe.as_raw_fd()))
        .ok()
        .map(|metadata| metadata.ino())
}

/// The processes but this one that hold an end of a pipe of `inodes`, each as
/// "PID (its command line)".
fn pipe_holders(inodes: &[u64]) -> Vec<String> {
    let pipes: Vec<String> = inodes
        .iter()
        .map(|inode| format!("pipe:[{inode}]"))
        .collect();
    let me = std::process::id().to_string();
    let Ok(processes) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    processes
        .flatten()
        .filter(|process| {
            let name = process.file_name();
            let name = name.to_string_lossy();
            name != me && name.bytes().all(|b| b.is_ascii_digit())
        })
        .filter(|process| {
            fs::read_dir(process.path().join("fd")).is_ok_and(|fds| {
                fds.flatten().any(|fd| {
                    fs::read_link(fd.path())
                        .is_ok_and(|target| pipes.iter().any(|pipe| target == Path::new(pipe)))
                })
            })
        })
        .map(|process| {
            let cmdline = fs::read(process.path().join("cmdline")).unwrap_or_default();
            format!(
                "{} ({})",
                process.file_name().to_string_lossy(),
                String::from_utf8_lossy(&cmdline)
                    .replace('\0', " ")
                    .trim_end()
            )
        })
        .collect()
}

/// A pipe read to its end by a thread; its text so far is available at any time.
struct Capture {
    buf: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    thread: thread::JoinHandle<()>,
}

impl Capture {
    fn start(pipe: Option<impl Read + Send + 'static>) -> Capture {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = buf.clone();
        let thread = thread::spawn(move || {
            let Some(mut pipe) = pipe else { return };
            let mut chunk = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Capture { buf, thread }
    }

    fn done(&self) -> bool {
        self.thread.is_finished()
    }

    fn bytes(&self) -> Vec<u8> {
        self.buf.lock().unwrap().clone()
    }

    fn text(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.buf.lock().unwrap()).into_owned();
        if !self.done() {
            text.push_str("\n<output still open: a child of vmctl holds it>");
        }
        text
    }
}

/// SIGKILLs process `pid`, its process group and every descendant (found in /proc).
pub(crate) fn kill_tree(pid: u32) {
    let mut victims = vec![pid];
    let mut i = 0;
    while i < victims.len() {
        let parent = victims[i];
        if let Ok(entries) = fs::read_dir("/proc") {
            for e in entries.flatten() {
                let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                    continue;
                };
                let stat = fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                // "pid (comm) state ppid ...": comm may hold spaces, so parse after ')'.
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|p| p.parse::<u32>().ok());
                if ppid == Some(parent) && !victims.contains(&child) {
                    victims.push(child);
                }
            }
        }
        i += 1;
    }
    let mut kill = Command::new("kill");
    kill.arg("-KILL").arg("--").arg(format!("-{pid}"));
    kill.args(victims.iter().map(|p| p.to_string()));
    let _ = kill.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

impl Default for Vmctl {
    fn default() -> Self {
        Vmctl::new()
    }
}

/// Boots the test initramfs running `script` as `/etc/vmtest.sh`, with extra `vmctl`
/// arguments; asserts a clean exit and returns the run.
pub fn boot_script(dir: &TempDir, script: &str, extra_args: &[&OsStr]) -> Run {
    let initrd = test_initramfs(dir, script);
    let run = Vmctl::boot(&initrd).args(extra_args).run();
    eprintln!("{}", run.report());
    run.assert_success();
    run
}

/// The value after `KEY=` on the first stdout line holding it (serial output may carry
/// `\r` and kernel messages around it).
pub fn guest_value<'a>(stdout: &'a str, key: &str) -> Option<&'a str> {
    let needle = format!("{key}=");
    stdout.lines().find_map(|line| {
        let at = line.find(&needle)?;
        Some(
            line[at + needle.len()..]
                .trim_end_matches(['\r', '\n'])
                .trim(),
        )
    })
}

/// A workspace directory and `vmctl` with its state (XDG_STATE_HOME) beside it, in
/// the test's own temporary directory; dropping it removes the workspace's VM.
pub struct Workspace {
    pub dir: TempDir,
    /// Set when vmctl runs as another user than the tests.
    runner: Option<Runner>,
}

/// How vmctl runs as another user: who, with which environment, and the directory
/// that holds the artifacts handed to it (kept as long as the workspace).
struct Runner {
    user: host_user::HostUser,
    env: Vec<(&'static str, OsString)>,
    _artifacts: TempDir,
}

impl Workspace {
    pub fn new(name: &str) -> Self {
        let workspace = Self {
            dir: TempDir::new(name),
            runner: None,
        };
        std::fs::create_dir_all(workspace.path())
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", workspace.path().display()));
        workspace
    }

    /// A workspace whose vmctl runs as `user`, who owns the workspace, vmctl's state
    /// and a home directory for it ([`host_user`]).
    pub fn new_as(name: &str, user: &host_user::HostUser) -> Self {
        let mut workspace = Self::new(name);
        let home = workspace.dir.join("home");
        std::fs::create_dir_all(&home)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", home.display()));
        let artifacts = TempDir::new(&format!("{name}-artifacts"));
        let mut env: Vec<(&'static str, OsString)> = host_user::artifact_env(user, &artifacts)
            .into_iter()
            .map(|(variable, path)| (variable, path.into_os_string()))
            .collect();
        env.extend(host_user::login_env(user, &home));
        if !user.is_current() {
            host_user::give_to(workspace.dir.path(), user);
        }
        workspace.runner = Some(Runner {
            user: user.clone(),
            env,
            _artifacts: artifacts,
        });
        workspace
    }

    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("ws")
    }

    /// The directory of the workspace's VM (its logs, sockets, supervisor.pid); panics
    /// when there is none.
    pub fn vm_dir(&self) -> PathBuf {
        find_vm_dir(&self.state()).expect("the workspace has a VM directory")
    }

    /// The user's config directory for this test's vmctl (`VMCTL_CONFIG` points in
    /// it): config.toml, policy.json, secrets.json.
    pub fn config_dir(&self) -> PathBuf {
        self.dir.join("config")
    }

    /// Writes `toml` as this test's vmctl config file (`config.toml` in
    /// [`Workspace::config_dir`]) and returns its path.
    pub fn write_config(&self, toml: &str) -> PathBuf {
        let file = self.config_dir().join("config.toml");
        std::fs::create_dir_all(self.config_dir())
            .and_then(|()| std::fs::write(&file, toml))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", file.display()));
        file
    }

    /// `vmctl ARGS` run in the workspace, with stdin from /dev/null.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = match &self.runner {
            Some(runner) => {
                let mut command = host_user::command_as(&runner.user, vmctl_bin());
                command.envs(runner.env.iter().map(|(k, v)| (k, v)));
                command
            }
            None => Command::new(vmctl_bin()),
        };
        command
            .args(args)
            .current_dir(self.path())
            .envs(self.vmctl_env())
            .stdin(Stdio::null());
        command
    }

    /// What makes a vmctl use this test's state and config directories, not the
    /// user's (`~/.config/vmctl`, whose typo would fail the test): for a vmctl the test
    /// starts another way than [`Workspace::command`] (through a terminal).
    pub fn vmctl_env(&self) -> [(&'static str, PathBuf); 2] {
        [
            ("XDG_STATE_HOME", self.state()),
            ("VMCTL_CONFIG", self.config_dir().join("config.toml")),
        ]
    }

    /// The VM of this workspace as `vmctl ps --json` lists it; panics when vmctl fails
    /// or lists it not once.
    pub fn ps_row(&self) -> ps::PsRow {
        let output = self.run(&["ps", "--json"]);
        assert_ok(&output, "vmctl ps --json");
        let rows = ps::parse(&stdout(&output)).unwrap_or_else(|e| panic!("{e}"));
        ps::row_of(&rows, &self.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .clone()
    }

    /// Runs `vmctl ARGS` and logs what it printed; panics with "timed out" when it
    /// takes longer than [`vm_timeout`] (a hung guest must fail the test, not hang it),
    /// and when a process it left behind still holds its stdout or stderr 5 s after
    /// it exited.
    pub fn run(&self, args: &[&str]) -> Output {
        self.run_with_env(args, &[])
    }

    /// [`Workspace::run`] with more environment variables for vmctl.
    pub fn run_with_env(&self, args: &[&str], env: &[(&str, &Path)]) -> Output {
        let mut child = self
            .command(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run vmctl {args:?}: {e}"));
        let pipes = Pipes::read(&mut child);
        let Some(status) = hang_report::wait_bounded(&mut child, vm_timeout()) else {
            if hang_report::report(self, args, &mut child)
                == Some(hang_report::Verdict::EndedAfterDiagnosis)
            {
                LOST_WAKEUP_SUSPECTED.with(|suspected| suspected.set(true));
            }
            let _ = child.kill();
            let _ = child.wait();
            panic!("vmctl {args:?} timed out after {:?}", vm_timeout());
        };
        let output = pipes.output(status, &format!("vmctl {args:?}"), "vmctl's");
        if vmctl_says_its_vm_was_lost(&String::from_utf8_lossy(&output.stderr)) {
            mark_vm_lost();
        }
        eprintln!(
            "vmctl {args:?} -> {:?}\nstdout: {}\nstderr: {}",
            output.status.code(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    /// A step that failed without vmctl's words (a pipe that broke, a spawned vmctl
    /// whose stderr went to the terminal) may still have lost its VM: `vmctl ps` lists
    /// the crash its supervisor recorded, which makes the scenario worth another try.
    fn note_a_crash_under_the_failure(&self) {
        let Ok(ps) = self.command(&["ps"]).output() else {
            return;
        };
        let table = String::from_utf8_lossy(&ps.stdout);
        if VM_LOST_SIGNS.iter().any(|sign| table.contains(sign)) {
            // Uncaptured, as the retry that follows: CI's log shows what crashed, and
            // the console's end, which the test's directory takes with it.
            let console = self
                .command(&["logs"])
                .output()
                .map(|logs| String::from_utf8_lossy(&logs.stdout).into_owned())
                .unwrap_or_default();
            let lines: Vec<&str> = console.lines().collect();
            let tail = lines[lines.len().saturating_sub(CONSOLE_TAIL_LINES)..].join("\n");
            let _ = writeln!(
                std::io::stderr(),
                "\nthe workspace's VM crashed under this failure:\n{table}\n\
                 the last {CONSOLE_TAIL_LINES} lines of its console:\n{}",
                indented(&tail)
            );
            VM_LOST.with(|lost| lost.set(true));
        }
    }

    /// `vmctl secret set NAME ARGS` with `value` on stdin (`None`: stdin closed at once).
    pub fn set_secret(&self, name: &str, args: &[&str], value: Option<&str>) -> Output {
        let mut child = self
            .command(&[&["secret", "set", name], args].concat())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run vmctl secret set");
        let mut stdin = child.stdin.take().expect("vmctl's stdin");
        if let Some(value) = value {
            // A refusal before reading leaves nobody to read: a broken pipe is its
            // answer, which the exit status tells.
            let _ = stdin.write_all(value.as_bytes());
        }
        drop(stdin);
        child.wait_with_output().expect("vmctl secret set")
    }

    /// `vmctl exec -- sh -c SCRIPT`.
    pub fn exec(&self, script: &str) -> Output {
        self.run(&["exec", "--", "sh", "-c", script])
    }

    /// `vmctl exec --user root -- sh -c SCRIPT`.
    pub fn exec_as_root(&self, script: &str) -> Output {
        self.run(&["exec", "--user", "root", "--", "sh", "-c", script])
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        if thread::panicking() {
            self.note_a_crash_under_the_failure();
        }
        self.record_made_up_wakeups();
        // Sessions start vmctl's daemon on demand (one per state directory). Bounded
        // even here: a stuck `rm` must not hang the run while a test unwinds. A
        // failure is said (past the capture: the test may pass): the state directory
        // goes next, under whatever it left running.
        for args in [&["rm"][..], &["daemon", "--stop"]] {
            let Ok(mut child) = self
                .command(args)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
            else {
                continue;
            };
            let pipes = Pipes::read(&mut child);
            match hang_report::wait_bounded(&mut child, vm_timeout()) {
                None => {
                    let _ = writeln!(
                        std::io::stderr(),
                        "vm-tests: vmctl {args:?} did not end within {:?}; killed",
                        vm_timeout()
                    );
                    kill_tree(child.id());
                    let _ = child.wait();
                }
                Some(status) if !status.success() => {
                    pipes.ended_within_grace();
                    let _ = writeln!(
                        std::io::stderr(),
                        "vm-tests: removing the test's VM: vmctl {args:?} in {} failed \
                         ({status}); its stderr:\n{}",
                        self.path().display(),
                        indented(&pipes.err.text())
                    );
                }
                Some(_) => {}
            }
        }
    }
}

impl Workspace {
    /// Records, in [`wakeup_file`], the lost wake-ups the VMMs of this workspace's VMs
    /// made up for so far, as their supervisor logs say (a restarted VM's previous log
    /// too), before `vmctl rm` takes the logs away.
    fn record_made_up_wakeups(&self) {
        let Ok(vms) = std::fs::read_dir(self.state().join("vmctl/vms")) else {
            return;
        };
        let logs = vms.flatten().flat_map(|vm| {
            ["supervisor.log.previous", "supervisor.log"].map(|name| vm.path().join(name))
        });
        let whose = self.path().display().to_string();
        for log in logs {
            let log = std::fs::read(log).unwrap_or_default();
            record_made_up_wakeups(&String::from_utf8_lossy(&log), &whose);
        }
    }
}

/// How much of a crashed VM's console a failing test prints.
const CONSOLE_TAIL_LINES: usize = 40;

/// Marks the scenario on this thread as one that lost its VM: worth another attempt.
pub(crate) fn mark_vm_lost() {
    VM_LOST.with(|lost| lost.set(true));
}

/// The directory of the one VM whose vmctl state is under `state`, if there is one.
pub fn find_vm_dir(state: &Path) -> Option<PathBuf> {
    let mut vms = std::fs::read_dir(state.join("vmctl/vms")).ok()?;
    Some(vms.next()?.ok()?.path())
}

/// A VM test's body: skipped (loudly) where no VM can run, else the scenario, retried
/// when the nested host loses its VM ([`retry_if_vm_lost`]).
pub fn vm_scenario(test: &str, scenario: fn()) {
    if vm_available(test) {
        retry_if_vm_lost(test, scenario);
    }
}

/// [`vm_scenario`] for a scenario whose VMs run in a nested host whatever this machine
/// has (through `vmctl nested-exec`): a hardware-KVM machine runs its nested host in
/// QEMU-TCG as well, with the same known losses, retried as they are there.
pub fn nested_scenario(test: &str, scenario: fn()) {
    if nested_host_available(test) {
        retry_if_lost_within(test, scenario, NESTED_ATTEMPTS);
    }
}

/// How many times a scenario whose VM the nested host may lose is run at most.
const NESTED_ATTEMPTS: u32 = 4;

/// Guests in the nested host sometimes crash or hang under sustained device traffic
/// (README, "Known problem"). There, a scenario that loses its VM that way is retried,
/// loudly and recorded in [`retry_file`] (which `scripts/test.sh` reports), at most
/// three times; any other failure fails at once. On hardware KVM nothing is retried:
/// a lost VM there is a failure of ours.
pub fn retry_if_vm_lost(test: &str, scenario: fn()) {
    let attempts = if hardware_kvm() { 1 } else { NESTED_ATTEMPTS };
    retry_if_lost_within(test, scenario, attempts);
}

fn retry_if_lost_within(test: &str, scenario: fn(), attempts: u32) {
    for attempt in 1..=attempts {
        VM_LOST.with(|lost| lost.set(false));
        NO_RETRY.with(|no_retry| no_retry.set(false));
        LOST_WAKEUP_SUSPECTED.with(|suspected| suspected.set(false));
        match std::panic::catch_unwind(scenario) {
            Ok(()) => return,
            Err(panic)
                if attempt < attempts
                    && !NO_RETRY.with(|no_retry| no_retry.get())
                    && (vm_was_lost(panic.as_ref()) || VM_LOST.with(|lost| lost.get())) =>
            {
                let message = panic_message(panic.as_ref());
                let why = retry_reason(
                    message,
                    LOST_WAKEUP_SUSPECTED.with(|suspected| suspected.get()),
                );
                // Straight to the process's stderr, like a skip: libtest would capture
                // it once the scenario passes, and a CI log should show every retry,
                // with all the failure said (a table, a log's tail) to tell later
                // whether it was the nested host or a bug of ours.
                let _ = writeln!(
                    std::io::stderr(),
                    "\nRETRY: attempt {attempt} lost its VM (the known nested-host crash or \
                     hang; it failed with: {why}); starting over with a fresh VM\n\
                     The whole failure of attempt {attempt}:\n{}\n",
                    indented(message)
                );
                append_line(
                    &retry_file(),
                    &format!("RETRIED VM TEST {test} (attempt {attempt}): {why}"),
                    "retry",
                );
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// From here on the current attempt of the scenario is not retried, whatever it fails
/// with: for a scenario that makes its VM crash on purpose, whose assertions quote the
/// crash.
pub fn no_retry_from_here() {
    NO_RETRY.with(|no_retry| no_retry.set(true));
}

thread_local! {
    /// Set by [`Workspace::run`] when vmctl reported its VM lost, whatever assertion
    /// then failed: the scenario (on this thread) is worth another attempt.
    static VM_LOST: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set by [`no_retry_from_here`].
    static NO_RETRY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set by [`Workspace::run`] when a command that timed out ended once the hang
    /// report's traffic went through: said with the retry, which may hide a bug.
    static LOST_WAKEUP_SUSPECTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What vmctl or a panic says when the VM went away under a scenario.
const VM_LOST_SIGNS: [&str; 15] = [
    "timed out",
    "stopped making progress",
    // The benchmark's and vmctl's bounds on a guest agent's answer: a guest the nested
    // host stalled does not answer.
    "no answer within",
    "did not start the command within",
    // `vmctl up`'s bound on a booting VM: a guest stalled after its agent started
    // listening (as seen in CI, 2026-12-02) never answers the first health check.
    "the guest agent did not answer within",
    // The benchmark's per-script timeout: a guest the nested host stalled leaves its
    // script unfinished (a script that always hangs still fails every attempt).
    "did not finish within",
    // The benchmark's bound on a VM it boots itself: a stalled guest prints nothing more.
    "the guest did not print",
    // The guest kernel's own report that one of its vCPUs stopped running.
    "rcu_sched detected stalls on CPUs",
    // vmctl's report of a guest kernel panic, and of the nested host's own (README,
    // "Known problem").
    "the guest kernel crashed",
    "the nested host's kernel crashed",
    "the VM stopped",
    "closed the connection",
    "guest crashed",
    "the nested host stopped before the VM finished",
    "the nested host stalled",
];

/// Whether vmctl's own lines on its stderr (`vmctl: ...`, `vmctl-vmm: ...`) say its
/// VM was lost. The guest command's stderr comes on the same stream and does not
/// count: a probe's `TimeoutError: timed out` or curl's "Connection timed out" is the
/// command failing, which a retry must not hide.
fn vmctl_says_its_vm_was_lost(stderr: &str) -> bool {
    stderr
        .lines()
        .map(|line| line.trim_start_matches('\r'))
        .filter(|line| line.starts_with("vmctl: ") || line.starts_with("vmctl-vmm: "))
        .any(|line| VM_LOST_SIGNS.iter().any(|sign| line.contains(sign)))
}

/// Where a failure's message starts quoting a command's stderr, which relays the
/// guest command's own: past it, only vmctl's own lines are read for a lost VM.
pub const QUOTED_OUTPUT: &str =
    "--- its stderr (only vmctl's own lines in it can mean a lost VM) ---";

/// Asserts that `output` (of a vmctl that ran a guest command) succeeded, quoting its
/// stderr after [`QUOTED_OUTPUT`].
pub fn assert_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed ({})\n{QUOTED_OUTPUT}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

fn vm_was_lost(panic: &(dyn std::any::Any + Send)) -> bool {
    let message = panic_message(panic);
    let (own, quoted) = message.split_once(QUOTED_OUTPUT).unwrap_or((message, ""));
    VM_LOST_SIGNS.iter().any(|sign| own.contains(sign)) || vmctl_says_its_vm_was_lost(quoted)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("")
}

/// Added to a retry's reason when the hang report saw the timed-out command end once
/// its own traffic went through; `scripts/test.sh` counts these apart.
const LOST_WAKEUP_NOTE: &str =
    " [LOST WAKE-UP? the hang report saw the command end once its diagnosis's traffic went through]";

/// What a retry is said and recorded to be for: the failure's telling line, marked
/// when a lost wake-up is suspected. Such a scenario is retried all the same (a
/// command of a slow nested guest may merely have been about to finish), but
/// `scripts/test.sh` counts it apart.
fn retry_reason(message: &str, lost_wakeup_suspected: bool) -> String {
    let mut why = telling_line(message);
    if lost_wakeup_suspected {
        why.push_str(LOST_WAKEUP_NOTE);
    }
    why
}

/// `text` with each line indented, to set a quoted failure apart from the test's own
/// lines in a log.
fn indented(text: &str) -> String {
    text.lines()
        .map(|line| format!("    | {line}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The line of a failure's message that shows the VM was lost (a long log's first line
/// may say only that a log follows), else its first line; cut to a log line's length.
fn telling_line(message: &str) -> String {
    const MAX_CHARS: usize = 300;
    let line = message
        .lines()
        .find(|line| VM_LOST_SIGNS.iter().any(|sign| line.contains(sign)))
        .or_else(|| message.lines().next())
        .unwrap_or("");
    match line.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_string(),
    }
}

/// Runs a host program (in `dir`, if given) and returns its stdout; panics with its
/// stderr if it fails.
pub fn host_output(program: &str, args: &[&str], dir: Option<&Path>) -> String {
    let mut command = Command::new(program);
    command.args(args);
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout(&output)
}

/// A command's stdout as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A command's stderr as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// How far the guest's clock may be off the host's, in seconds: the nested host sets
/// its clock from the host's to within half a 9p round trip. (A guest clock stepped to
/// the time in a message of the host's reads between the host's before and after.)
pub const CLOCK_TOLERANCE_S: f64 = 0.25;
/// vmctl's setting of how often the supervisor keeps the guest's clock in step.
pub const CLOCK_SYNC_VAR: &str = "VMCTL_CLOCK_SYNC_SECS";

/// `time` as seconds since the Unix epoch, as `date +%s.%N` prints it.
pub fn seconds_since_epoch(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .expect("a clock before 1970")
        .as_secs_f64()
}

/// Runs `date_last` (a guest command whose output ends with `date +%s.%N`) and
/// asserts that the guest's reading lies between the host's before and after; returns
/// the reading.
pub fn assert_guest_clock_is_hosts(when: &str, date_last: impl FnOnce() -> Output) -> f64 {
    let before = seconds_since_epoch(SystemTime::now());
    let output = date_last();
    let after = seconds_since_epoch(SystemTime::now());
    assert!(
        output.status.success(),
        "reading the guest's clock {when} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = stdout(&output);
    let guest_now: f64 = text
        .lines()
        .last()
        .and_then(|line| line.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `date +%s.%N` reading at the end of {text:?}"));
    assert!(
        (before - CLOCK_TOLERANCE_S..=after + CLOCK_TOLERANCE_S).contains(&guest_now),
        "the guest's clock {when} reads {guest_now:.3}: off the host's ({before:.3} to \
         {after:.3})"
    );
    guest_now
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VMM's lines of lost wake-ups made up for are found in a supervisor log;
    /// the summaries as the VM ends and other lines are not.
    #[test]
    fn the_vmms_made_up_wakeups_are_found_in_its_log() {
        let log = "vmctl: supervising the VM of /w\n\
             2026-12-07T13:00:00Z  WARN vmm::devices::virtio::mmio: virtio device type 26: \
             the driver left its interrupt unacknowledged for half a second: interrupt \
             raised again (a lost interrupt; 1 so far)\n\
             2026-12-07T13:00:01Z  WARN vmm::devices::virtio::mmio: virtio device type 3: \
             chains on queue 1 waited half a second for a notification that did not come: \
             served (a lost notification, or a driver held up before it notified; 1 so far)\n\
             2026-12-07T13:00:02Z  WARN vmm::builder: virtio-mmio slot 3: 1 missed \
             notification(s) served\n";
        let found: Vec<&str> = made_up_wakeups(log).collect();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("type 26"), "{found:?}");
        assert!(found[1].contains("type 3"), "{found:?}");
    }

    #[test]
    fn a_build_script_gives_the_file_it_printed_last_or_says_what_went_wrong() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let artifact = dir.path().join("artifact.bin");
        std::fs::write(&artifact, b"x").unwrap();
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path.display().to_string()
        };
        // Progress may come before the path; a trailing empty line after it is allowed.
        let good = script(
            "good.sh",
            &format!("echo building; echo {}; echo", artifact.display()),
        );
        assert_eq!(try_build_artifact(&good, &[]), Ok(artifact.clone()));
        let missing = script("missing.sh", "echo /nonexistent/artifact");
        let error = try_build_artifact(&missing, &[]).unwrap_err();
        assert!(
            error.contains("\"/nonexistent/artifact\", which is not a file"),
            "{error}"
        );
        let failing = script("failing.sh", "exit 3");
        let error = try_build_artifact(&failing, &["guest"]).unwrap_err();
        assert!(error.contains("failing.sh guest failed"), "{error}");
        assert!(error.contains("run scripts/setup.sh first"), "{error}");
    }

    #[test]
    fn a_lost_vm_is_told_from_other_failures() {
        let lost = |message: &str| vm_was_lost(&message.to_string());
        assert!(lost(
            "vm-bench: error: fs_create_files_s run 1/1 (guest: vmctl exec -- bash -c SCRIPT) \
             did not finish within 120 s: killed"
        ));
        assert!(lost(
            "vmctl: the guest kernel crashed ([ 1.6] BUG: unable to handle page fault); \
             stdout closed before the guest printed BENCH-INIT-REACHED"
        ));
        assert!(lost(
            "exec 0 failed: the agent closed the connection unexpectedly"
        ));
        assert!(lost(
            "vmctl: error: the nested host's kernel crashed (not the guest's): Kernel panic"
        ));
        assert!(lost(
            "vm-bench: error: workspace VM: exec round trip 20/20 of true through \
             /tmp/x/vsock.sock: no answer within 60 s"
        ));
        assert!(lost(
            "egress: vmctl up: ... failed (exit status: 1)\n--- stderr (tail) ---\nvmctl: error: \
             the VM of /tmp/w did not come up: the guest agent did not answer within 240 s; \
             see `vmctl logs --supervisor /tmp/w` (the host side) and `vmctl logs /tmp/w` (the \
             guest's console), in /tmp/s"
        ));
        assert!(!lost("assertion `left == right` failed: left: \"job-1\""));
        // A command's stderr quoted in the failure: the guest's own timeout is not
        // vmctl's, which still counts there.
        let quoted =
            |stderr: &str| format!("probe failed (exit status: 1)\n{QUOTED_OUTPUT}\n{stderr}");
        assert!(!lost(&quoted(
            "Traceback (most recent call last):\nTimeoutError: timed out\n"
        )));
        assert!(lost(&quoted(
            "vmctl: error: the agent closed the connection; the VM stopped: the guest crashed\n"
        )));
        // A panic with a payload that is not text is not taken for a lost VM.
        assert!(!vm_was_lost(&42));
    }

    #[test]
    fn only_vmctls_own_lines_say_its_vm_was_lost() {
        // The guest command's stderr, relayed: its timeouts are its own failures.
        assert!(!vmctl_says_its_vm_was_lost(
            "Traceback (most recent call last):\nTimeoutError: timed out\n\
             curl: (28) Connection timed out after 5001 milliseconds\n\
             echo says the VM stopped\n"
        ));
        // vmctl's own words, also after the command's output and on a terminal's line.
        assert!(vmctl_says_its_vm_was_lost(
            "some output\nvmctl: error: connecting to the guest agent timed out after 60 s\n"
        ));
        assert!(vmctl_says_its_vm_was_lost(
            "\rvmctl: error: the agent closed the connection; the VM stopped: the guest \
             crashed (triple fault on vCPU 1)\r\n"
        ));
        assert!(vmctl_says_its_vm_was_lost(
            "vmctl-vmm: error: the VM stopped: the guest crashed (triple fault on vCPU 0)\n"
        ));
        // vmctl's lines without a sign.
        assert!(!vmctl_says_its_vm_was_lost(
            "vmctl: no-such-program: command not found (in the VM)\n"
        ));
    }

    #[test]
    fn a_process_that_keeps_the_pipes_fails_the_wait_for_them_and_is_named() {
        // The child exits at once; a process it left behind (in a session of its own,
        // as a daemon) keeps its stdout and stderr.
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("holder.pid");
        let mut child = Command::new("sh")
            .args(["-c", "setsid sleep 30 & echo $! > \"$0\"; echo started"])
            .arg(&pid_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pipes = Pipes::read(&mut child);
        let status = child.wait().unwrap();
        let started = Instant::now();
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pipes.output(status, "sh -c ...", "its")
        }));
        let holder = fs::read_to_string(&pid_file).unwrap();
        let _ = Command::new("kill").arg(holder.trim()).status();
        let panic = failed.expect_err("the wait outlived the grace");
        let message = panic_message(panic.as_ref()).to_string();
        assert!(started.elapsed() < PIPES_GRACE * 2, "{message}");
        assert!(
            message.contains("a process still holds its stdout/stderr: ")
                && message.contains(&format!("{} (sleep 30)", holder.trim())),
            "{message}"
        );
        assert!(!vm_was_lost(panic.as_ref()), "{message}");

        // Pipes that end with the child give its output.
        let mut child = Command::new("sh")
            .args(["-c", "echo out; echo err >&2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pipes = Pipes::read(&mut child);
        let status = child.wait().unwrap();
        let output = pipes.output(status, "sh -c ...", "its");
        assert_eq!(
            (&output.stdout[..], &output.stderr[..]),
            (&b"out\n"[..], &b"err\n"[..])
        );
    }

    #[test]
    fn a_retry_quotes_the_failures_telling_line_cut_short() {
        assert_eq!(
            telling_line("exec 3 failed: gone\nmore"),
            "exec 3 failed: gone"
        );
        assert_eq!(
            telling_line(
                "vm-bench failed; its log:\nstarted\nround trip 20: no answer within 60 s"
            ),
            "round trip 20: no answer within 60 s"
        );
        assert_eq!(telling_line(""), "");
        let long = "é".repeat(400);
        assert_eq!(telling_line(&long), format!("{}...", "é".repeat(300)));
    }

    /// `scripts/test.sh` counts the retries that may hide a lost wake-up by this mark.
    #[test]
    fn a_retry_after_a_suspected_lost_wake_up_is_marked() {
        let message = "vmctl [\"exec\"] timed out after 240s\nmore";
        assert_eq!(
            retry_reason(message, false),
            "vmctl [\"exec\"] timed out after 240s"
        );
        let marked = retry_reason(message, true);
        assert!(
            marked.starts_with("vmctl [\"exec\"] timed out after 240s")
                && marked.contains("LOST WAKE-UP?"),
            "{marked}"
        );
        let script = std::fs::read_to_string(workspace_root().join("scripts/test.sh"))
            .expect("read scripts/test.sh");
        assert!(
            script.contains("'LOST WAKE-UP?'"),
            "test.sh counts another mark"
        );
    }

    #[test]
    fn newc_layout() {
        let a = newc_archive(&[CpioEntry {
            path: "etc/x",
            mode: 0o100644,
            data: b"hi",
        }]);
        assert!(a.starts_with(b"070701"));
        assert_eq!(a.len() % 4, 0);
        // header 110 + "etc/x\0" 6 -> 116 (aligned), data 2 -> pad to 120, then trailer.
        assert_eq!(&a[110..116], b"etc/x\0");
        assert_eq!(&a[116..118], b"hi");
        assert_eq!(&a[120..126], b"070701");
        assert!(a.ends_with(b"TRAILER!!!\0\0\0\0"));
    }

    #[test]
    fn appended_archive_is_aligned() {
        let img = initramfs_with_script(&[1, 2, 3], "echo hi\n");
        assert_eq!(&img[..3], &[1, 2, 3]);
        assert_eq!(&img[512..518], b"070701");
    }

    #[test]
    fn newc_is_read_by_cpio() {
        // scripts/setup.sh installs cpio (the initramfs builds need it too).
        assert!(
            find_executable(Path::new("cpio")).is_some(),
            "no cpio: run scripts/setup.sh"
        );
        let dir = TempDir::new("cpio");
        let a = newc_archive(&[
            CpioEntry {
                path: "etc",
                mode: 0o040755,
                data: &[],
            },
            CpioEntry {
                path: "etc/vmtest.sh",
                mode: 0o100755,
                data: b"echo hi\n",
            },
        ]);
        fs::write(dir.join("a.cpio"), &a).unwrap();
        let out = Command::new("cpio")
            .args(["-i", "-d", "--quiet", "-F"])
            .arg(dir.join("a.cpio"))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(fs::read(dir.join("etc/vmtest.sh")).unwrap(), b"echo hi\n");
    }

    #[test]
    fn timeout_kills_the_whole_tree_and_keeps_output() {
        let run = Vmctl::new()
            .program("/bin/sh")
            .args(["-c", "sleep 1000 & echo started; echo oops >&2; sleep 1000"])
            .timeout(Duration::from_secs(1))
            .run();
        assert!(run.timed_out, "{}", run.report());
        assert_eq!(run.code, None);
        assert_eq!(run.stdout, "started\n", "{}", run.report());
        assert_eq!(run.stderr, "oops\n", "{}", run.report());
        assert!(run.elapsed < Duration::from_secs(5), "{}", run.report());
    }

    #[test]
    fn exit_code_and_output_are_captured() {
        let run = Vmctl::new()
            .program("/bin/sh")
            .args(["-c", "echo out; echo err >&2; exit 3"])
            .run();
        assert_eq!(
            (run.code, run.stdout.as_str(), run.stderr.as_str()),
            (Some(3), "out\n", "err\n")
        );
        assert!(!run.timed_out);
    }

    #[test]
    fn guest_value_parses_serial_lines() {
        let out = "[    0.1] boot\r\nNPROC=2\r\nX=a b\n";
        assert_eq!(guest_value(out, "NPROC"), Some("2"));
        assert_eq!(guest_value(out, "X"), Some("a b"));
        assert_eq!(guest_value(out, "Y"), None);
    }
}
