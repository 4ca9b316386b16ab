//! PID-1 duties: mounts, the overlay root, switch-root, loopback, hostname, the host
//! user's account, virtio-fs shares, the "agent ready" signal and power-off.
//!
//! Everything here is best effort: a failing step prints a clear message on the
//! console and the agent still serves, except when the root or a share cannot be
//! mounted (then the VM powers off with the reason).

use std::ffi::CString;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{chown, DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::protocol::DEFAULT_PORT;
use crate::server::HostUser;
use crate::shares::{self, ShareMount};

/// Errors of the init steps.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("invalid kernel command line parameter {param}: {reason}")]
    Cmdline { param: String, reason: String },
    #[error("{what}: {source}")]
    Sys {
        what: String,
        source: std::io::Error,
    },
}

fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> InitError {
    let what = what.into();
    move |source| InitError::Sys { what, source }
}

/// The per-VM writable layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upper {
    Tmpfs,
    /// An ext4 block device, e.g. `/dev/vdb`.
    Device(String),
}

/// The kernel parameter of [`BootConfig::run`].
pub const RUN_KEY: &str = "vmctl.run";

/// Configuration from the kernel command line (`vmctl.*` parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    /// `vmctl.root=`: the read-only ext4 root image.
    pub root: Option<String>,
    /// `vmctl.upper=`: `tmpfs` (default) or a block device.
    pub upper: Upper,
    /// `vmctl.user=NAME:UID:GID:HOME`.
    pub user: Option<HostUser>,
    /// `vmctl.hostname=`.
    pub hostname: Option<String>,
    /// `vmctl.port=`: the vsock port to listen on.
    pub port: u32,
    /// `vmctl.share=TAG:PATH[:ro]` (repeatable): virtio-fs shares, mounted in order.
    pub shares: Vec<ShareMount>,
    /// `vmctl.run=PATH` (percent-encoded like a share's path): run this program once,
    /// then power off, instead of serving on vsock. For a guest under a VMM without
    /// our vsock device (the benchmark's QEMU comparison).
    pub run: Option<PathBuf>,
    /// `vmctl.drop_caches_idle=SECS`: drop the caches after this long without a
    /// command ([`crate::idle_caches`]); `0` or absent: never.
    pub drop_caches_idle: Option<Duration>,
}

impl Default for BootConfig {
    fn default() -> Self {
        Self {
            root: None,
            upper: Upper::Tmpfs,
            user: None,
            hostname: None,
            port: DEFAULT_PORT,
            shares: Vec::new(),
            run: None,
            drop_caches_idle: None,
        }
    }
}

fn bad(param: &str, reason: impl Into<String>) -> InitError {
    InitError::Cmdline {
        param: param.to_string(),
        reason: reason.into(),
    }
}

/// Parses `vmctl.user=NAME:UID:GID:HOME`.
pub fn parse_user(value: &str) -> Result<HostUser, InitError> {
    let param = format!("vmctl.user={value}");
    let mut f = value.splitn(4, ':');
    let (Some(name), Some(uid), Some(gid), Some(home)) = (f.next(), f.next(), f.next(), f.next())
    else {
        return Err(bad(&param, "expected NAME:UID:GID:HOME"));
    };
    let valid_name = !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        && !name.starts_with('-');
    if !valid_name {
        return Err(bad(&param, "invalid user name"));
    }
    let uid = uid
        .parse()
        .map_err(|_| bad(&param, "UID is not a number"))?;
    let gid = gid
        .parse()
        .map_err(|_| bad(&param, "GID is not a number"))?;
    if !home.starts_with('/') || home.contains(':') || home.contains('\n') {
        return Err(bad(&param, "HOME must be an absolute path"));
    }
    Ok(HostUser {
        name: name.to_string(),
        uid,
        gid,
        home: home.to_string(),
    })
}

/// The most bytes of a host name the guest takes (`vmctl.hostname=`).
pub const HOSTNAME_MAX_LEN: usize = 64;

/// Whether the guest takes `name` as its host name: letters, digits, '-' and '.'.
pub fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= HOSTNAME_MAX_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// `name` as a host name the guest takes: every other character becomes '-' (a
/// workspace `my_project` is host `my-project`), cut to `HOSTNAME_MAX_LEN`.
pub fn hostname_from(name: &str) -> String {
    let hostname: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(HOSTNAME_MAX_LEN)
        .collect();
    if hostname.is_empty() {
        "vm".into()
    } else {
        hostname
    }
}

/// Parses the kernel command line. Unknown parameters are ignored; invalid
/// `vmctl.*` values are returned as warnings and left at their defaults.
pub fn parse_cmdline(cmdline: &str) -> (BootConfig, Vec<InitError>) {
    let mut cfg = BootConfig::default();
    let mut warnings = Vec::new();
    for word in cmdline.split_whitespace() {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        match key {
            "vmctl.root" if !value.is_empty() => cfg.root = Some(value.to_string()),
            "vmctl.upper" => match value {
                "tmpfs" => cfg.upper = Upper::Tmpfs,
                v if v.starts_with("/dev/") => cfg.upper = Upper::Device(v.to_string()),
                v => warnings.push(bad(
                    word,
                    format!("expected 'tmpfs' or /dev/..., got '{v}'"),
                )),
            },
            "vmctl.user" => match parse_user(value) {
                Ok(u) => cfg.user = Some(u),
                Err(e) => warnings.push(e),
            },
            "vmctl.hostname" => {
                if valid_hostname(value) {
                    cfg.hostname = Some(value.to_string());
                } else {
                    warnings.push(bad(word, "invalid host name"));
                }
            }
            "vmctl.port" => match value.parse::<u32>() {
                Ok(p) if p > 0 => cfg.port = p,
                _ => warnings.push(bad(word, "not a port number")),
            },
            shares::CMDLINE_KEY => match ShareMount::parse(value) {
                Ok(s) => cfg.shares.push(s),
                Err(e) => warnings.push(bad(word, e.to_string())),
            },
            crate::idle_caches::CMDLINE_KEY => match value.parse::<u64>() {
                Ok(0) => cfg.drop_caches_idle = None,
                Ok(secs) => cfg.drop_caches_idle = Some(Duration::from_secs(secs)),
                Err(_) => warnings.push(bad(word, "not a number of seconds")),
            },
            RUN_KEY => match shares::decode_path(value) {
                Ok(path) => cfg.run = Some(path),
                Err(e) => warnings.push(bad(word, e.to_string())),
            },
            _ => {}
        }
    }
    (cfg, warnings)
}

/// Whether this process is PID 1 (the VM's init).
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

/// Prints to the console (stderr, which init points at the virtio console or
/// `/dev/console`, see `open_console`).
pub fn console(msg: &str) {
    let mut e = std::io::stderr().lock();
    let _ = writeln!(e, "guest-agent: {msg}");
}

fn cstr(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

/// mount(2) wrapper.
pub fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), InitError> {
    let (src, tgt, fs, dat) = (cstr(source), cstr(target), cstr(fstype), cstr(data));
    // SAFETY: all pointers are valid NUL-terminated strings living across the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            if fstype.is_empty() {
                std::ptr::null()
            } else {
                fs.as_ptr()
            },
            flags,
            if data.is_empty() {
                std::ptr::null()
            } else {
                dat.as_ptr().cast()
            },
        )
    };
    if r < 0 {
        return Err(InitError::Sys {
            what: format!("mount {source} on {target} ({fstype} {data})"),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn mkdir_p(path: &str, mode: u32) {
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path);
}

/// Mounts `fstype` on `target` (creating it), reporting failures on the console.
fn mount_logged(source: &str, target: &str, fstype: &str, flags: libc::c_ulong, data: &str) {
    mkdir_p(target, 0o755);
    if let Err(e) = mount(source, target, fstype, flags, data) {
        // EBUSY: already mounted (e.g. the kernel's devtmpfs automount).
        if !matches!(&e, InitError::Sys { source, .. } if source.raw_os_error() == Some(libc::EBUSY))
        {
            console(&format!("warning: {e}"));
        }
    }
}

/// Points fds 0, 1 and 2 at the console: the virtio console (`/dev/hvc0`) when the
/// VMM offers one, else `/dev/console` (the kernel's, the 8250, which costs a VM exit
/// per byte: 12 ms a line in the nested host, against 2 ms); when neither opens, at a
/// placeholder (see [`fill_standard_fds`]). The initramfs has no device nodes, so the
/// kernel could not open the console for us.
fn open_console() {
    let open = |path: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            // PID 1 must not take a terminal as its controlling one: a hangup there
            // would signal it.
            .custom_flags(libc::O_NOCTTY)
            .open(path)
    };
    match open(VIRTIO_CONSOLE).or_else(|_| open("/dev/console")) {
        Ok(f) => {
            for fd in 0..3 {
                // SAFETY: dup2 onto the standard descriptors; `f` stays open during the
                // call.
                unsafe { libc::dup2(f.as_raw_fd(), fd) };
            }
        }
        Err(_) => fill_standard_fds(CONSOLE_PLACEHOLDERS),
    }
}

/// The virtio console's terminal, there when the VMM offers the device.
pub const VIRTIO_CONSOLE: &str = "/dev/hvc0";

/// What stands in for the console on fds 0-2 when it cannot be opened: `/dev/null`,
/// or, without devtmpfs, the root directory (which reads and writes fail on).
const CONSOLE_PLACEHOLDERS: &[&std::ffi::CStr] = &[c"/dev/null", c"/"];

/// Opens each of fds 0-2 that is closed on the first of `placeholders` that opens.
/// A free one would go to the next descriptor opened (the vsock listener, a host
/// connection), and the log lines written to stderr into a host connection.
/// Async-signal-safe: it allocates nothing.
fn fill_standard_fds(placeholders: &[&std::ffi::CStr]) {
    for fd in 0..3 {
        // SAFETY: F_GETFD only reads the descriptor's flags; no pointers involved.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            continue;
        }
        for path in placeholders {
            // A directory opens read-only only.
            let Some(opened) = [libc::O_RDWR, libc::O_RDONLY]
                .into_iter()
                .find_map(|flags| {
                    // SAFETY: open with a valid NUL-terminated path. Not close-on-exec:
                    // the standard descriptors are inherited.
                    let opened = unsafe { libc::open(path.as_ptr(), flags) };
                    (opened >= 0).then_some(opened)
                })
            else {
                continue;
            };
            // The lowest free number: `fd` itself, unless a lower one was free too.
            if opened != fd {
                // SAFETY: dup2 and close on descriptors this function opened.
                unsafe {
                    libc::dup2(opened, fd);
                    libc::close(opened);
                }
            }
            break;
        }
    }
}

fn mount_basic_early() {
    mount_logged("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755");
    open_console();
    mount_logged(
        "proc",
        "/proc",
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    );
    mount_logged(
        "sysfs",
        "/sys",
        "sysfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    );
}

/// The mounts every VM gets in its final root.
fn mount_runtime_dirs() {
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    mount_logged("proc", "/proc", "proc", nosuid_nodev | libc::MS_NOEXEC, "");
    mount_logged("sysfs", "/sys", "sysfs", nosuid_nodev | libc::MS_NOEXEC, "");
    mount_logged("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755");
    mount_logged(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620,gid=5",
    );
    // /dev/ptmx must refer to this devpts instance.
    let _ = std::fs::remove_file("/dev/ptmx");
    if std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx").is_err() {
        console("warning: cannot link /dev/ptmx to pts/ptmx");
    }
    mount_logged("tmpfs", "/dev/shm", "tmpfs", nosuid_nodev, "mode=1777");
    mount_logged(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        nosuid_nodev | libc::MS_NOEXEC,
        "nsdelegate",
    );
    mount_logged("tmpfs", "/tmp", "tmpfs", nosuid_nodev, "mode=1777");
    mount_logged("tmpfs", "/run", "tmpfs", nosuid_nodev, "mode=0755");
    for (src, dst) in [
        ("/proc/self/fd", "/dev/fd"),
        ("/proc/self/fd/0", "/dev/stdin"),
        ("/proc/self/fd/1", "/dev/stdout"),
        ("/proc/self/fd/2", "/dev/stderr"),
    ] {
        let _ = std::os::unix::fs::symlink(src, dst);
    }
}

/// Deletes the initramfs' files (not crossing into other mounts), like busybox
/// `switch_root`, so it holds no memory beyond the running agent binary.
fn delete_initramfs(dir: &Path, root_dev: u64, skip: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path == skip {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != root_dev {
            continue;
        }
        if meta.is_dir() {
            delete_initramfs(&path, root_dev, skip);
            let _ = std::fs::remove_dir(&path);
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Where the writable shares' read-only views are mounted (root only).
const SHARE_VIEWS: &str = "/run/vmctl/share-views";

/// A read-only bind mount of each writable share, in a directory only root can enter:
/// where the guest agent checks the names the host changed
/// ([`crate::host_edits::HostEditTarget::recheck`]) without any chance of creating a
/// file. `None` (and a console warning) where the mount failed.
pub fn read_only_views(shares: &[std::path::PathBuf]) -> Vec<Option<std::path::PathBuf>> {
    mkdir_p(SHARE_VIEWS, 0o700);
    let _ = std::fs::set_permissions(SHARE_VIEWS, std::fs::Permissions::from_mode(0o700));
    shares
        .iter()
        .enumerate()
        .map(|(at, share)| {
            let view = format!("{SHARE_VIEWS}/{at}");
            mkdir_p(&view, 0o700);
            let source = share.to_string_lossy();
            let mounted = mount(&source, &view, "", libc::MS_BIND, "").and_then(|()| {
                mount(
                    &source,
                    &view,
                    "",
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                    "",
                )
            });
            match mounted {
                Ok(()) => Some(std::path::PathBuf::from(view)),
                Err(e) => {
                    console(&format!(
                        "warning: {}: no read-only view ({e}); a file the host replaces there \
                         may look like the old one in the guest for a second",
                        share.display()
                    ));
                    None
                }
            }
        })
        .collect()
}

/// Builds the overlay root at `/mnt/root` and switches into it.
fn switch_root(cfg: &BootConfig, root_dev: &str) -> Result<(), InitError> {
    let (lower, upper, newroot) = ("/mnt/lower", "/mnt/upper", "/mnt/root");
    for d in [lower, upper, newroot] {
        mkdir_p(d, 0o755);
    }
    mount(root_dev, lower, "ext4", libc::MS_RDONLY, "")?;
    match &cfg.upper {
        Upper::Tmpfs => mount("tmpfs", upper, "tmpfs", 0, "mode=0755")?,
        Upper::Device(dev) => mount(dev, upper, "ext4", 0, "")?,
    }
    mkdir_p("/mnt/upper/upper", 0o755);
    mkdir_p("/mnt/upper/work", 0o755);
    mount(
        "overlay",
        newroot,
        "overlay",
        0,
        "lowerdir=/mnt/lower,upperdir=/mnt/upper/upper,workdir=/mnt/upper/work",
    )?;
    // The overlay holds its layers; their own mount points are not needed.
    for d in [lower, upper] {
        let c = cstr(d);
        // SAFETY: umount2 with a valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    // Drop the initramfs' early mounts; fresh ones are made in the new root.
    for d in ["/proc", "/sys", "/dev"] {
        let c = cstr(d);
        // SAFETY: umount2 with a valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    let root_meta = std::fs::symlink_metadata("/").map_err(sys("stat /"))?;
    delete_initramfs(Path::new("/"), root_meta.dev(), Path::new(newroot));
    std::env::set_current_dir(newroot).map_err(sys(format!("chdir {newroot}")))?;
    mount(".", "/", "", libc::MS_MOVE, "")?;
    let dot = cstr(".");
    // SAFETY: chroot with a valid NUL-terminated path.
    if unsafe { libc::chroot(dot.as_ptr()) } < 0 {
        return Err(InitError::Sys {
            what: "chroot into the new root".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    std::env::set_current_dir("/").map_err(sys("chdir /"))?;
    Ok(())
}

/// Brings up the loopback interface (the kernel assigns 127.0.0.1/8 and ::1 itself
/// once `lo` is up).
pub fn loopback_up() -> Result<(), InitError> {
    // SAFETY: socket() has no memory-safety preconditions.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(InitError::Sys {
            what: "socket for SIOCSIFFLAGS".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: an all-zero ifreq is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo\0".iter().enumerate() {
        ifr.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the live ifreq; fd is ours.
    let r = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            -1
        } else {
            ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr)
        }
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: closing the socket we opened.
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(InitError::Sys {
            what: "bring up lo".into(),
            source: err,
        });
    }
    Ok(())
}

pub fn set_hostname(name: &str) -> Result<(), InitError> {
    // SAFETY: the pointer and length describe a live byte slice.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } < 0 {
        return Err(InitError::Sys {
            what: format!("sethostname {name}"),
            source: std::io::Error::last_os_error(),
        });
    }
    let _ = std::fs::write("/etc/hostname", format!("{name}\n"));
    if let Err(e) = name_in_hosts(Path::new("/"), name) {
        console(&format!(
            "warning: the hostname {name} does not resolve (hostname -f, Java's getLocalHost): \
             cannot add it to /etc/hosts: {e}"
        ));
    }
    Ok(())
}

/// Has `root`'s `/etc/hosts` name `name` (at 127.0.1.1, as Debian's installer does),
/// unless a line names it already: the machine's own name must resolve, and the guest
/// has no DNS (`hostname -f`, Python's `gethostbyname(gethostname())` and Java's
/// `InetAddress.getLocalHost()`, which Gradle and Maven call, failed).
fn name_in_hosts(root: &Path, name: &str) -> std::io::Result<()> {
    let path = root.join("etc/hosts");
    let hosts = match std::fs::read_to_string(&path) {
        Ok(hosts) => hosts,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let named = hosts.lines().any(|line| {
        let line = line.split('#').next().unwrap_or_default();
        line.split_whitespace().skip(1).any(|alias| alias == name)
    });
    if named {
        return Ok(());
    }
    let separator = if hosts.is_empty() || hosts.ends_with('\n') {
        ""
    } else {
        "\n"
    };
    std::fs::write(&path, format!("{hosts}{separator}127.0.1.1\t{name}\n"))
}

/// The name field of a passwd, group or shadow line.
fn name_of(line: &str) -> Option<&str> {
    line.split(':').next()
}

/// The third field of a passwd or group line: its uid or gid.
fn id_of(line: &str) -> Option<u32> {
    line.split(':').nth(2)?.parse().ok()
}

fn has_entry(text: &str, name: &str) -> bool {
    text.lines().any(|l| name_of(l) == Some(name))
}

fn has_id(text: &str, id: u32) -> bool {
    text.lines().any(|l| id_of(l) == Some(id))
}

/// `passwd` with the host user's entry as commands need it, or `None` when it already
/// is. An image account of the host user's name keeps its comment and shell but takes
/// the host's ids and home, or `whoami` (and ssh, npm, git) would not find a name for
/// the uid commands run as. The entry goes before any other account of the same uid,
/// so the uid's name is the host's, as on the host.
fn passwd_with_host_user(passwd: &str, user: &HostUser, default_shell: &str) -> Option<String> {
    let own_line = |l: &&str| name_of(l) == Some(user.name.as_str());
    let (comment, shell) = match passwd
        .lines()
        .find(own_line)
        .map(|l| l.split(':').collect::<Vec<_>>())
    {
        Some(f) if f.len() >= 7 => (f[4].to_string(), f[6].to_string()),
        _ => (String::new(), default_shell.to_string()),
    };
    let entry = format!(
        "{}:x:{}:{}:{comment}:{}:{shell}",
        user.name, user.uid, user.gid, user.home
    );
    let mut lines: Vec<&str> = Vec::new();
    let mut placed = false;
    for line in passwd.lines() {
        let own = own_line(&line);
        if !placed && (own || id_of(line) == Some(user.uid)) {
            lines.push(&entry);
            placed = true;
        }
        if !own {
            lines.push(line);
        }
    }
    if !placed {
        lines.push(&entry);
    }
    let mut text = lines.join("\n");
    text.push('\n');
    (text != passwd).then_some(text)
}

fn append_line(path: &Path, line: &str) -> Result<(), InitError> {
    let mut text = std::fs::read_to_string(path).unwrap_or_default();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    std::fs::write(path, text).map_err(sys(format!("write {}", path.display())))
}

/// Adds the host user to `<root>/etc/{passwd,group,shadow}` if missing, and creates
/// its home directory owned by it.
pub fn ensure_user(root: &Path, user: &HostUser) -> Result<(), InitError> {
    let etc = root.join("etc");
    mkdir_p(&etc.to_string_lossy(), 0o755);
    let passwd_path = etc.join("passwd");
    let passwd = std::fs::read_to_string(&passwd_path).unwrap_or_default();
    let shell = ["/bin/bash", "/bin/sh"]
        .into_iter()
        .find(|s| root.join(s.trim_start_matches('/')).exists())
        .unwrap_or("/bin/sh");
    let image_account = passwd
        .lines()
        .filter_map(crate::users::parse_passwd_line)
        .find(|e| e.name == user.name);
    if let Some(text) = passwd_with_host_user(&passwd, user, shell) {
        std::fs::write(&passwd_path, text)
            .map_err(sys(format!("write {}", passwd_path.display())))?;
    }
    let group_path = etc.join("group");
    let group = std::fs::read_to_string(&group_path).unwrap_or_default();
    if !has_id(&group, user.gid) && !has_entry(&group, &user.name) {
        append_line(&group_path, &format!("{}:x:{}:", user.name, user.gid))?;
    }
    let shadow_path = etc.join("shadow");
    let shadow = std::fs::read_to_string(&shadow_path).unwrap_or_default();
    if !has_entry(&shadow, &user.name) {
        append_line(&shadow_path, &format!("{}:!:19000:0:99999:7:::", user.name))?;
        let _ = std::fs::set_permissions(&shadow_path, std::fs::Permissions::from_mode(0o640));
    }
    let home = root.join(user.home.trim_start_matches('/'));
    if !home.exists() {
        std::fs::create_dir_all(&home).map_err(sys(format!("mkdir {}", home.display())))?;
        chown(&home, Some(user.uid), Some(user.gid))
            .map_err(sys(format!("chown {}", home.display())))?;
        let _ = std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755));
    } else if let Some(image) = image_account.filter(|a| a.home == user.home) {
        // The image made this home for its own ids: the host user must at least be
        // able to write in it (what the image put inside stays the image's).
        let owned_by_image = std::fs::symlink_metadata(&home)
            .is_ok_and(|m| m.is_dir() && m.uid() == image.uid && image.uid != user.uid);
        if owned_by_image {
            std::os::unix::fs::lchown(&home, Some(user.uid), Some(user.gid))
                .map_err(sys(format!("chown {}", home.display())))?;
        }
    }
    Ok(())
}

/// The kernel gives PID 1 1,024 open files (4,096 at most), and every relayed
/// connection (egress, loopback ports) costs the agent two: past 512, `accept` would
/// fail for every session. Commands get the usual 1,024 back
/// ([`crate::server::COMMAND_OPEN_FILES`]), with this higher ceiling.
fn raise_open_files_limit() {
    let limit = libc::rlimit {
        rlim_cur: AGENT_OPEN_FILES,
        rlim_max: crate::server::OPEN_FILES_CEILING,
    };
    // SAFETY: setrlimit reads one rlimit from a live local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } < 0 {
        console(&format!(
            "warning: cannot raise the open files limit: {}",
            std::io::Error::last_os_error()
        ));
    }
}

/// The agent's own open files limit.
const AGENT_OPEN_FILES: libc::rlim_t = 65_536;

/// Runs the PID-1 boot sequence; returns the configuration to serve with. Powers off
/// when a root was requested but cannot be mounted, or when a share cannot be mounted
/// (commands must not run on an empty directory where the user expects their files).
pub fn boot() -> BootConfig {
    mount_basic_early();
    raise_open_files_limit();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_else(|e| {
        console(&format!(
            "warning: cannot read /proc/cmdline: {e}; using defaults"
        ));
        String::new()
    });
    let (cfg, warnings) = parse_cmdline(&cmdline);
    for w in warnings {
        console(&format!("warning: {w} (ignored)"));
    }
    match &cfg.root {
        Some(root) => {
            if let Err(e) = switch_root(&cfg, root) {
                console(&format!(
                    "fatal: cannot set up the root filesystem from {root}: {e}"
                ));
                power_off();
            }
        }
        None => console(
            "warning: no vmctl.root= on the kernel command line; serving from the initramfs",
        ),
    }
    mount_runtime_dirs();
    if let Err(e) = loopback_up() {
        console(&format!("warning: {e}"));
    }
    if let Some(h) = &cfg.hostname {
        if let Err(e) = set_hostname(h) {
            console(&format!("warning: {e}"));
        }
    }
    if let Some(u) = &cfg.user {
        if let Err(e) = ensure_user(Path::new("/"), u) {
            console(&format!(
                "warning: cannot create the account of {}: {e}",
                u.name
            ));
        }
    }
    // In the given order, so a parent share is mounted before the shares inside it.
    for share in &cfg.shares {
        let owner = cfg.user.as_ref().map(|user| shares::HomeOwner {
            home: Path::new(&user.home),
            uid: user.uid,
            gid: user.gid,
        });
        if let Err(e) = shares::mount_share(share, owner) {
            console(&format!(
                "fatal: cannot mount share {}={}: {e}",
                shares::CMDLINE_KEY,
                share.to_cmdline_value()
            ));
            power_off();
        }
        if let Err(e) = shares::set_read_ahead(&share.path, shares::READ_AHEAD_KIB) {
            console(&format!(
                "warning: sequential reads of {} stay slow: cannot set its read-ahead: {e}",
                share.path.display()
            ));
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mounts: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    console(&format!(
        "booted: root {} (upper {:?}), hostname {}, user {}, mounts {}",
        cfg.root.as_deref().unwrap_or("initramfs"),
        cfg.upper,
        cfg.hostname.as_deref().unwrap_or("-"),
        cfg.user.as_ref().map(|u| u.name.as_str()).unwrap_or("-"),
        mounts.join(" ")
    ));
    cfg
}

/// The VMM's boot-timer I/O port: writing [`READY_VALUE`] there tells it the agent is
/// listening.
pub const BOOT_TIMER_PORT: u16 = 0x3f0;
pub const READY_VALUE: u8 = 123;

/// Signals "agent ready" to the VMM (PID 1 on x86_64 only; harmless elsewhere).
pub fn signal_ready() {
    #[cfg(target_arch = "x86_64")]
    if is_pid1() {
        // SAFETY: ioperm only changes this process's I/O permission bitmap.
        if unsafe { libc::ioperm(BOOT_TIMER_PORT as libc::c_ulong, 1, 1) } == 0 {
            // SAFETY: ioperm granted access to this single port; writing a byte to the
            // VMM's boot-timer device has no effect on our memory.
            unsafe {
                std::arch::asm!("out dx, al", in("dx") BOOT_TIMER_PORT, in("al") READY_VALUE, options(nomem, nostack, preserves_flags));
            }
        } else {
            tracing::warn!("ioperm(0x3f0) failed: {}", std::io::Error::last_os_error());
        }
    }
}

/// Runs `program` as root, in its own directory, with the console as its output and
/// nothing as its input; says how it ended, then powers off. Its exit status is on the
/// console only: the VM's end is a reset either way.
pub fn run_once_then_power_off(program: &Path) -> ! {
    let dir = program.parent().unwrap_or(Path::new("/"));
    let started = std::process::Command::new(program)
        .current_dir(dir)
        .env_clear()
        .env("PATH", crate::server::DEFAULT_PATH)
        .env("HOME", "/root")
        .env("USER", "root")
        .env("LOGNAME", "root")
        .stdin(std::process::Stdio::null())
        .status();
    match started {
        Ok(status) => console(&format!("{RUN_KEY}: {} {status}", program.display())),
        Err(e) => console(&format!("{RUN_KEY}: cannot run {}: {e}", program.display())),
    }
    power_off()
}

/// How long processes have to end after SIGTERM before they are killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// As an init does at shutdown: every other process gets SIGTERM, and SIGKILL if it is
/// still there after [`SHUTDOWN_GRACE`], so that a program with files open in a share
/// (a database in the workspace, a build writing its output) can close them cleanly
/// before the reset. Only as PID 1, which every orphan is reparented to: once it has
/// no child left, nothing else runs.
fn end_processes() {
    if std::process::id() != 1 {
        return;
    }
    // -1: every process but PID 1 itself.
    ask_to_end(-1);
    if children_left_after(SHUTDOWN_GRACE) {
        console("shutdown: processes still running after SIGTERM; killing them");
        // SAFETY: as above.
        unsafe { libc::kill(-1, libc::SIGKILL) };
        children_left_after(Duration::from_secs(1));
    }
}

/// SIGTERM to `target` (a `kill` target), then SIGCONT, as killall5 and systemd do: a
/// stopped process (an editor suspended with Ctrl-Z) would otherwise act on the
/// SIGTERM only once killed, and never close its files.
fn ask_to_end(target: libc::pid_t) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(target, libc::SIGTERM);
        libc::kill(target, libc::SIGCONT);
    }
}

/// Reaps children as they end for up to `wait`; whether any is left then.
fn children_left_after(wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    while reap_children() {
        if Instant::now() >= deadline {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Reaps the children that have ended; whether any is left.
fn reap_children() -> bool {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid pointer to a local int.
        match unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } {
            0 => return true,
            pid if pid > 0 => continue,
            _ => return std::io::Error::last_os_error().raw_os_error() != Some(libc::ECHILD),
        }
    }
}

/// Ends every process, syncs the filesystems and resets the VM (the VMM treats a reset
/// as "VM ended").
pub fn power_off() -> ! {
    end_processes();
    // SAFETY: sync and reboot have no memory-safety preconditions.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    // Not PID 1 or no CAP_SYS_BOOT: just exit.
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a forked child (the test harness needs its own fds 0-2) whose standard
    /// descriptors are closed, the placeholders fill them, the first that opens
    /// winning: the next descriptor opened is not one of them. (Other tests' files,
    /// open at the fork, may hold 3 and up.)
    #[test]
    fn closed_standard_fds_are_filled_with_a_placeholder() {
        // SAFETY: the child makes async-signal-safe calls only (close, the fill, open,
        // fcntl, _exit), as a fork of a multi-threaded process must.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: see above; the child exits without returning to the harness.
            unsafe {
                for fd in 0..3 {
                    libc::close(fd);
                }
                fill_standard_fds(&[c"/no/such/console", c"/"]);
                let all_open = (0..3).all(|fd| libc::fcntl(fd, libc::F_GETFD) >= 0);
                let next = libc::open(c"/".as_ptr(), libc::O_RDONLY);
                libc::_exit(match (all_open, next) {
                    (false, _) => 1,
                    (true, next) if next > 2 => 0,
                    (true, _) => 2,
                });
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid pointer to a local int.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(libc::WIFEXITED(status), "the child died: status {status}");
        match libc::WEXITSTATUS(status) {
            0 => {}
            1 => panic!("fds 0-2 were not all filled"),
            code => panic!("the next descriptor opened took 0-2 (child exit {code})"),
        }
    }

    /// A stopped process that handles SIGTERM gets to run its handler. (Review: only
    /// SIGTERM was sent, and a suspended editor was SIGKILLed 5 s later instead.)
    #[test]
    fn a_stopped_process_asked_to_end_runs_its_handler() {
        let dir = tempfile::tempdir().unwrap();
        let said = dir.path().join("said");
        let script = format!(
            "trap 'echo bye > {}; exit 0' TERM; kill -STOP $$; while :; do sleep 0.05; done",
            said.display()
        );
        let mut child = std::process::Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        let deadline = Instant::now() + Duration::from_secs(10);
        let state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after_name = stat.rsplit_once(") ")?.1.to_owned();
                    after_name.chars().next()
                })
        };
        while state() != Some('T') {
            assert!(Instant::now() < deadline, "the shell never stopped itself");
            std::thread::sleep(Duration::from_millis(10));
        }
        ask_to_end(pid);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the stopped process never ran its SIGTERM handler");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(std::fs::read_to_string(&said).unwrap(), "bye\n");
    }

    #[test]
    fn parses_cmdline() {
        let (cfg, warnings) = parse_cmdline(
            "console=ttyS0 reboot=k panic=1 vmctl.root=/dev/vda vmctl.upper=/dev/vdb \
             vmctl.user=alice:1000:1000:/home/alice vmctl.hostname=box-1 vmctl.port=2000 quiet \
             vmctl.share=ws:/home/alice/my%20project vmctl.share=cache.1:/home/alice/my%20project/c%3Aro:ro",
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(cfg.root.as_deref(), Some("/dev/vda"));
        assert_eq!(cfg.upper, Upper::Device("/dev/vdb".into()));
        assert_eq!(
            cfg.user,
            Some(HostUser {
                name: "alice".into(),
                uid: 1000,
                gid: 1000,
                home: "/home/alice".into()
            })
        );
        assert_eq!(cfg.hostname.as_deref(), Some("box-1"));
        assert_eq!(cfg.port, 2000);
        assert_eq!(
            cfg.shares,
            vec![
                ShareMount {
                    tag: "ws".into(),
                    path: "/home/alice/my project".into(),
                    read_only: false
                },
                ShareMount {
                    tag: "cache.1".into(),
                    path: "/home/alice/my project/c:ro".into(),
                    read_only: true
                },
            ]
        );
    }

    #[test]
    fn the_idle_time_before_the_caches_go_is_seconds_and_0_is_never() {
        let idle = |cmdline: &str| {
            let (cfg, warnings) = parse_cmdline(cmdline);
            (cfg.drop_caches_idle, warnings.len())
        };
        assert_eq!(idle("quiet"), (None, 0));
        assert_eq!(
            idle("vmctl.drop_caches_idle=300"),
            (Some(Duration::from_secs(300)), 0)
        );
        assert_eq!(idle("vmctl.drop_caches_idle=0"), (None, 0));
        assert_eq!(idle("vmctl.drop_caches_idle=5m"), (None, 1));
        assert_eq!(idle("vmctl.drop_caches_idle=-1"), (None, 1));
    }

    #[test]
    fn any_name_becomes_a_host_name_the_guest_takes() {
        for (name, hostname) in [
            ("my_project-c61c616e", "my-project-c61c616e"),
            ("a.b-c", "a.b-c"),
            ("", "vm"),
            ("caf\u{e9}", "caf-"),
        ] {
            assert_eq!(hostname_from(name), hostname);
            assert!(valid_hostname(&hostname_from(name)), "{name}");
        }
        let long = hostname_from(&"x".repeat(100));
        assert_eq!(long.len(), HOSTNAME_MAX_LEN);
        assert!(valid_hostname(&long));
        assert!(!valid_hostname("a_b") && !valid_hostname(""));
    }

    #[test]
    fn cmdline_defaults_and_bad_values() {
        let (cfg, warnings) = parse_cmdline("console=ttyS0");
        assert_eq!(cfg, BootConfig::default());
        assert!(warnings.is_empty());
        let (cfg, warnings) = parse_cmdline(
            "vmctl.upper=tmpfs vmctl.user=bob:x:1:/h vmctl.port=abc vmctl.hostname=a/b vmctl.upper=zfs vmctl.user=:1:1:/h",
        );
        assert_eq!(cfg.upper, Upper::Tmpfs);
        assert_eq!(cfg.user, None);
        assert_eq!(cfg.port, DEFAULT_PORT);
        assert_eq!(cfg.hostname, None);
        assert_eq!(warnings.len(), 5);
        assert!(parse_user("a:1:2:relative").is_err());
        assert!(parse_user("a:1:2").is_err());

        // Bad shares are skipped with a warning naming them; good ones are kept in order.
        let bad_shares = [
            "vmctl.share=",
            "vmctl.share=ws",
            "vmctl.share=ws:relative",
            "vmctl.share=ws:/a/../b",
            "vmctl.share=ws:/",
            "vmctl.share=ws:/a%2",
            "vmctl.share=ws:/a%00",
            "vmctl.share=ws:/a:rw",
            "vmctl.share=bad/tag:/a",
        ];
        let cmdline = format!(
            "vmctl.share=one:/a {} vmctl.share=two:/a/b:ro",
            bad_shares.join(" ")
        );
        let (cfg, warnings) = parse_cmdline(&cmdline);
        let got: Vec<_> = cfg
            .shares
            .iter()
            .map(|s| (s.tag.as_str(), s.path.as_path(), s.read_only))
            .collect();
        assert_eq!(
            got,
            [
                ("one", Path::new("/a"), false),
                ("two", Path::new("/a/b"), true)
            ]
        );
        assert_eq!(warnings.len(), bad_shares.len(), "{warnings:?}");
        for (w, param) in warnings.iter().zip(bad_shares) {
            let w = w.to_string();
            assert!(w.contains(param) && w.contains("expected"), "{w}");
        }
    }

    #[test]
    fn a_program_to_run_once() {
        let (cfg, warnings) = parse_cmdline("vmctl.run=/ws/my%20dir/run.sh");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(cfg.run, Some(PathBuf::from("/ws/my dir/run.sh")));
        for bad in ["vmctl.run=run.sh", "vmctl.run=/a/../run.sh", "vmctl.run="] {
            let (cfg, warnings) = parse_cmdline(bad);
            assert_eq!(cfg.run, None, "{bad}");
            assert_eq!(warnings.len(), 1, "{bad}: {warnings:?}");
            assert!(warnings[0].to_string().contains(bad), "{}", warnings[0]);
        }
    }

    fn host_user() -> HostUser {
        HostUser {
            name: "dev".into(),
            uid: 4242,
            gid: 4243,
            home: "/home/dev".into(),
        }
    }

    #[test]
    fn an_image_account_of_the_host_users_name_takes_the_host_users_ids() {
        let image = "root:x:0:0:root:/root:/bin/sh\ndev:x:1000:1000:Dev,,,:/home/dev:/bin/zsh\nnobody:x:65534:65534::/:/bin/false\n";
        let text = passwd_with_host_user(image, &host_user(), "/bin/sh").unwrap();
        assert_eq!(
            text,
            "root:x:0:0:root:/root:/bin/sh\ndev:x:4242:4243:Dev,,,:/home/dev:/bin/zsh\nnobody:x:65534:65534::/:/bin/false\n"
        );
        assert_eq!(passwd_with_host_user(&text, &host_user(), "/bin/sh"), None);
    }

    #[test]
    fn the_host_users_uid_is_named_after_the_host_user() {
        let image = "root:x:0:0:root:/root:/bin/sh\nagent:x:4242:4242::/home/agent:/bin/bash\n";
        let text = passwd_with_host_user(image, &host_user(), "/bin/bash").unwrap();
        assert_eq!(
            text,
            "root:x:0:0:root:/root:/bin/sh\ndev:x:4242:4243::/home/dev:/bin/bash\nagent:x:4242:4242::/home/agent:/bin/bash\n"
        );
        assert_eq!(
            passwd_with_host_user(&text, &host_user(), "/bin/bash"),
            None
        );
        assert_eq!(
            passwd_with_host_user("", &host_user(), "/bin/sh").as_deref(),
            Some("dev:x:4242:4243::/home/dev:/bin/sh\n")
        );
    }

    #[test]
    fn the_image_accounts_home_becomes_the_host_users() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("home/dev/.config")).unwrap();
        for path in ["home/dev", "home/dev/.config"] {
            std::os::unix::fs::chown(dir.path().join(path), Some(1000), Some(1000)).unwrap();
        }
        std::fs::write(
            dir.path().join("etc/passwd"),
            "dev:x:1000:1000::/home/dev:/bin/sh\n",
        )
        .unwrap();
        ensure_user(dir.path(), &host_user()).unwrap();
        let owner = |path: &str| {
            let meta = std::fs::metadata(dir.path().join(path)).unwrap();
            (meta.uid(), meta.gid())
        };
        assert_eq!(owner("home/dev"), (4242, 4243));
        assert_eq!(owner("home/dev/.config"), (1000, 1000));
        let a = crate::users::lookup_in(dir.path(), "dev").unwrap();
        assert_eq!((a.uid, a.gid), (4242, 4243));
    }

    #[test]
    fn the_hostname_is_added_to_the_hosts_file_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        let hosts = dir.path().join("etc/hosts");
        std::fs::write(&hosts, "127.0.0.1\tlocalhost vmctl\n# 10.0.0.1 my-vm\n").unwrap();
        name_in_hosts(dir.path(), "my-vm").unwrap();
        name_in_hosts(dir.path(), "my-vm").unwrap();
        // The image's own name is there already.
        name_in_hosts(dir.path(), "vmctl").unwrap();
        assert_eq!(
            std::fs::read_to_string(&hosts).unwrap(),
            "127.0.0.1\tlocalhost vmctl\n# 10.0.0.1 my-vm\n127.0.1.1\tmy-vm\n"
        );
        // Without a hosts file, or one without its last line break.
        std::fs::write(&hosts, "127.0.0.1 localhost").unwrap();
        name_in_hosts(dir.path(), "a").unwrap();
        assert_eq!(
            std::fs::read_to_string(&hosts).unwrap(),
            "127.0.0.1 localhost\n127.0.1.1\ta\n"
        );
        std::fs::remove_file(&hosts).unwrap();
        name_in_hosts(dir.path(), "b").unwrap();
        assert_eq!(std::fs::read_to_string(&hosts).unwrap(), "127.0.1.1\tb\n");
    }

    #[test]
    fn ensure_user_appends_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(
            dir.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh",
        )
        .unwrap();
        std::fs::write(dir.path().join("etc/group"), "root:x:0:\n").unwrap();
        let u = HostUser {
            name: "dev".into(),
            uid: 4242,
            gid: 4243,
            home: "/home/dev".into(),
        };
        ensure_user(dir.path(), &u).unwrap();
        ensure_user(dir.path(), &u).unwrap();
        let passwd = std::fs::read_to_string(dir.path().join("etc/passwd")).unwrap();
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/sh\ndev:x:4242:4243::/home/dev:/bin/sh\n"
        );
        let group = std::fs::read_to_string(dir.path().join("etc/group")).unwrap();
        assert_eq!(group, "root:x:0:\ndev:x:4243:\n");
        let shadow = std::fs::read_to_string(dir.path().join("etc/shadow")).unwrap();
        assert_eq!(shadow.lines().count(), 1);
        let meta = std::fs::metadata(dir.path().join("home/dev")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (4242, 4243));
        let a = crate::users::lookup_in(dir.path(), "dev").unwrap();
        assert_eq!((a.uid, a.gid, a.home.as_str()), (4242, 4243, "/home/dev"));
    }
}
