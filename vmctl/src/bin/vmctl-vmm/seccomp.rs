//! Limits the VMM's system calls with a seccomp filter, installed once the VM is built
//! (its files open, its memory mapped, its devices connected) and before a vCPU runs
//! the guest's first instruction. What stays allowed is what running a VM takes: I/O
//! on descriptors it already holds, KVM's ioctls, epoll and eventfds, Unix sockets
//! (vsock connections, virtiofsd), memory that is never executable, its own threads
//! and signals. Not allowed, among the rest: opening files, executing programs,
//! creating processes, network sockets, signals to other processes (tgkill, or the
//! kernel's on a descriptor's I/O: fcntl's F_SETOWN and O_ASYNC), ptrace.
//!
//! A call outside the list stops the VMM with a report that names the call (SIGSYS),
//! instead of a silent kill: it is a bug of the VMM's, and the report says how to run
//! without the filter meanwhile. Opening a file is the exception: it fails with EACCES,
//! as Landlock would have it fail, and the VMM goes on. The C library opens files of
//! its own accord and copes with a refusal: glibc's malloc reads
//! /proc/sys/vm/overcommit_memory the first time it shrinks a thread's heap, which a
//! guest makes happen by streaming output to a reader that goes away (`yes | head`).

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::OnceLock;

use libc::{c_int, c_void, siginfo_t};
use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule,
};
use vmm::process::{Outcome, BINARY};
use vmm_sys_util::signal::register_signal_handler;

pub use vmm::process::SECCOMP_SWITCH_ENV as SWITCH_ENV;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("{SWITCH_ENV}={0:?} is not understood: use 'on' (the default) or 'off'")]
    BadSwitch(String),
    #[error("cannot build the VMM's seccomp filter: {0}")]
    Build(#[from] BackendError),
    #[error(
        "cannot install the VMM's seccomp filter: {0} ({SWITCH_ENV}=off runs the VMM \
         without it)"
    )]
    Install(#[from] seccompiler::Error),
    #[error("cannot install the handler that reports a forbidden system call: {0}")]
    Handler(vmm_sys_util::errno::Error),
}

/// Whether the filter is wanted: `VMCTL_SECCOMP` unset or `on`, unless `off`.
pub fn wanted() -> Result<bool, SeccompError> {
    switch(std::env::var(SWITCH_ENV).ok().as_deref())
}

fn switch(value: Option<&str>) -> Result<bool, SeccompError> {
    match value {
        None | Some("" | "on") => Ok(true),
        Some("off") => Ok(false),
        Some(other) => Err(SeccompError::BadSwitch(other.to_string())),
    }
}

/// Installs the filter on every thread of the process and on those it starts later.
/// A forbidden call is reported on `outcome_fd` as the VMM's [`Outcome`] when there is
/// one, else on stderr; then the process exits.
pub fn install(outcome_fd: Option<RawFd>) -> Result<(), SeccompError> {
    let programs = programs(std::process::id())?;
    let _ = FORBIDDEN_CALL_REPORT.set(ForbiddenCallReport::new(outcome_fd));
    register_signal_handler(libc::SIGSYS, on_forbidden_call).map_err(SeccompError::Handler)?;
    for program in &programs {
        seccompiler::apply_filter_all_threads(program)?;
    }
    Ok(())
}

/// The calls answered with an error instead of run, then the allowlist: clone3(2)
/// with ENOSYS, whose flags live in memory a filter cannot read, so that the C library
/// falls back to clone(2), whose flags the allowlist checks; and opening a file with
/// EACCES (see the module's comment). Of several filters the kernel takes the
/// strictest answer, so the allowlist must allow these calls for the refusals to be
/// heard; it goes last because installing a filter takes calls it does not allow.
fn programs(pid: u32) -> Result<[BpfProgram; 4], SeccompError> {
    let arch = std::env::consts::ARCH.try_into()?;
    let allowlist = SeccompFilter::new(
        allowed_calls(pid)?,
        SeccompAction::Trap,
        SeccompAction::Allow,
        arch,
    )?;
    let refusal = |calls: &[i64], errno: c_int| {
        SeccompFilter::new(
            calls.iter().map(|&call| (call, Vec::new())).collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(errno as u32),
            arch,
        )
    };
    let no_clone3 = refusal(&[libc::SYS_clone3], libc::ENOSYS)?;
    let no_open = refusal(OPEN_CALLS, libc::EACCES)?;
    let no_signals_by_descriptor = SeccompFilter::new(
        [(libc::SYS_fcntl, signals_by_descriptor()?)].into(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    Ok([
        no_clone3.try_into()?,
        no_open.try_into()?,
        no_signals_by_descriptor.try_into()?,
        allowlist.try_into()?,
    ])
}

/// The calls that open a file by its path, all refused with EACCES.
const OPEN_CALLS: &[i64] = &[
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_creat,
];

/// Allowed whatever their arguments.
const ALWAYS_ALLOWED: &[i64] = &[
    // I/O on the descriptors the VMM holds: disks, eventfds, sockets, its console.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fstat,
    libc::SYS_fcntl,
    libc::SYS_close,
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_poll,
    libc::SYS_ppoll,
    // Unix sockets (socket(2) itself is checked below): vsock connections both ways,
    // virtiofsd's vhost-user messages with their descriptors.
    libc::SYS_connect,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    // The vsock socket is removed when the VM ends (Landlock keeps it to its directory).
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    // Memory (mmap and mprotect are checked below).
    libc::SYS_brk,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    // Threads: the vCPUs, the device workers started when the guest's driver is ready.
    // (clone3 and the calls that open files are refused by filters of their own.)
    libc::SYS_clone3,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // Signals within the process: the vCPU kick, SIGINT/SIGTERM, abort().
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    // Time and randomness (the rng device, the C library's and Rust's own needs).
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_getrandom,
];

/// KVM's ioctls all carry its type, 0xAE, in bits 8 to 15 of their number.
const KVM_IOCTL_TYPE: u64 = 0xAE;

fn allowed_calls(pid: u32) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
    use SeccompCmpOp::{Eq, MaskedEq};
    let mut calls: BTreeMap<i64, Vec<SeccompRule>> = ALWAYS_ALLOWED
        .iter()
        .chain(OPEN_CALLS)
        .map(|&call| (call, Vec::new()))
        .collect();
    let no_exec = |prot_arg| rule(&[(prot_arg, MaskedEq(libc::PROT_EXEC as u64), 0)]);
    let empty_path = |flags_arg| {
        let flag = libc::AT_EMPTY_PATH as u64;
        rule(&[(flags_arg, MaskedEq(flag), flag)])
    };
    let thread = libc::CLONE_THREAD as u64;
    let ioctls = [libc::FIONBIO, libc::FIOCLEX, libc::FIONCLEX]
        .into_iter()
        .map(|request| rule(&[(1, Eq, request)]))
        .chain([rule(&[(1, MaskedEq(0xff00), KVM_IOCTL_TYPE << 8)])])
        .collect::<Result<_, _>>()?;
    let thread_names = [libc::PR_SET_NAME, libc::PR_GET_NAME]
        .into_iter()
        .map(|option| rule(&[(0, Eq, option as u64)]))
        .collect::<Result<_, _>>()?;
    calls.extend([
        (libc::SYS_ioctl, ioctls),
        (libc::SYS_prctl, thread_names),
        (
            libc::SYS_socket,
            vec![rule(&[(0, Eq, libc::AF_UNIX as u64)])?],
        ),
        (
            libc::SYS_clone,
            vec![rule(&[(0, MaskedEq(thread), thread)])?],
        ),
        (libc::SYS_tgkill, vec![rule(&[(0, Eq, u64::from(pid))])?]),
        (libc::SYS_mmap, vec![no_exec(2)?]),
        (libc::SYS_mprotect, vec![no_exec(2)?]),
        // AT_EMPTY_PATH, as glibc's fstat passes it. A filter cannot read the path, so
        // this does not keep a taken-over VMM from a non-empty one (AT_EMPTY_PATH only
        // applies to an empty path), and Landlock does not govern stat: the size,
        // owner and times of any host file it names are its to see. Only the jail's
        // mount namespace hides the host's paths; where it cannot be set up (no user
        // namespaces), they are not hidden.
        (libc::SYS_newfstatat, vec![empty_path(3)?]),
        (libc::SYS_statx, vec![empty_path(2)?]),
    ]);
    Ok(calls)
}

/// fcntl(2) commands the libc crate does not name (asm-generic/fcntl.h).
const F_SETSIG: c_int = 10;
const F_SETOWN_EX: c_int = 15;

/// The fcntl(2) commands refused with EPERM: those that make the kernel signal a
/// process of the descriptor's owner's choosing, any process of the user's (the
/// supervisor, the daemon, other VMs), when I/O happens on it (F_SETOWN, F_SETOWN_EX,
/// F_SETSIG, O_ASYNC) or its file changes (F_NOTIFY, F_SETLEASE). The VMM uses none;
/// the rest of fcntl stays allowed.
fn signals_by_descriptor() -> Result<Vec<SeccompRule>, BackendError> {
    use SeccompCmpOp::{Eq, MaskedEq};
    let async_flag = libc::O_ASYNC as u64;
    let mut rules = [
        libc::F_SETOWN,
        F_SETOWN_EX,
        F_SETSIG,
        libc::F_NOTIFY,
        libc::F_SETLEASE,
    ]
    .into_iter()
    .map(|command| rule(&[(1, Eq, command as u64)]))
    .collect::<Result<Vec<_>, _>>()?;
    rules.push(rule(&[
        (1, Eq, libc::F_SETFL as u64),
        (2, MaskedEq(async_flag), async_flag),
    ])?);
    Ok(rules)
}

/// A rule whose conditions (argument index, comparison, value) must all hold. Only
/// the low 32 bits of an argument are compared: the arguments checked here are C
/// `int`s (or, for ioctl and clone, numbers that fit in one), whose upper half the
/// caller need not clear.
fn rule(conditions: &[(u8, SeccompCmpOp, u64)]) -> Result<SeccompRule, BackendError> {
    let conditions = conditions
        .iter()
        .map(|(arg, op, value)| {
            SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, op.clone(), *value)
        })
        .collect::<Result<_, _>>()?;
    SeccompRule::new(conditions)
}

/// What the SIGSYS handler writes, prepared beforehand: a signal handler may not
/// allocate. The call's number goes between `before` and `after`.
struct ForbiddenCallReport {
    fd: RawFd,
    before: String,
    after: String,
    exit_code: c_int,
}

static FORBIDDEN_CALL_REPORT: OnceLock<ForbiddenCallReport> = OnceLock::new();

const NUMBER_MARK: &str = "{number}";

impl ForbiddenCallReport {
    fn new(outcome_fd: Option<RawFd>) -> Self {
        let error = format!(
            "the VMM was stopped at a system call its seccomp filter does not allow, \
             number {NUMBER_MARK} on {} (`ausyscall` gives its name): a bug of the VMM's, \
             please report it; {SWITCH_ENV}=off runs the VMM without the filter meanwhile",
            std::env::consts::ARCH
        );
        let outcome = Outcome::Failed { error };
        let (fd, text) = match outcome_fd {
            Some(fd) => (fd, serde_json::to_string(&outcome).unwrap_or_default()),
            None => (
                libc::STDERR_FILENO,
                format!("{BINARY}: error: {}", outcome.error().unwrap_or_default()),
            ),
        };
        let (before, after) = text.split_once(NUMBER_MARK).unwrap_or((&text, ""));
        Self {
            fd,
            before: before.to_string(),
            after: format!("{after}\n"),
            exit_code: c_int::from(outcome.exit_code()),
        }
    }
}

/// The SIGSYS handler: writes the report and exits, with nothing but write(2) and
/// _exit(2), which the filter allows and a signal handler may call.
extern "C" fn on_forbidden_call(_signal: c_int, info: *mut siginfo_t, _context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo; for SIGSYS its union holds the
    // faulting address (8 bytes) and then the call's number, an int at byte 24 of
    // the structure (`si_syscall`, which the libc crate does not name).
    let number = unsafe { info.cast::<u8>().add(24).cast::<c_int>().read() };
    let Some(report) = FORBIDDEN_CALL_REPORT.get() else {
        // SAFETY: _exit(2) ends the process without running anything of its own.
        unsafe { libc::_exit(1) }
    };
    let mut digits = [0u8; 12];
    let number = decimal(number, &mut digits);
    for part in [report.before.as_bytes(), number, report.after.as_bytes()] {
        write_all(report.fd, part);
    }
    // SAFETY: as above.
    unsafe { libc::_exit(report.exit_code) }
}

/// `value` in decimal, in `buffer`, without allocating.
fn decimal(value: c_int, buffer: &mut [u8; 12]) -> &[u8] {
    let mut start = buffer.len();
    let mut rest = i64::from(value).unsigned_abs();
    loop {
        start -= 1;
        buffer[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if value < 0 {
        start -= 1;
        buffer[start] = b'-';
    }
    &buffer[start..]
}

fn write_all(fd: RawFd, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for its length; write(2) reads no further.
        let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if written <= 0 {
            return;
        }
        bytes = &bytes[written as usize..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::os::unix::process::ExitStatusExt;
    use std::process::Command;

    use vmm_sys_util::eventfd::EventFd;

    /// Set in the copy of this test binary that a test starts to run under the filter:
    /// the forbidden call it makes once it has checked the allowed ones.
    const CHILD_ENV: &str = "VMCTL_VMM_SECCOMP_TEST_CALL";
    /// The directory the child puts its socket in: the child never returns to remove
    /// one of its own.
    const CHILD_DIR_ENV: &str = "VMCTL_VMM_SECCOMP_TEST_DIR";
    const THIS_TEST: &str = "seccomp::tests::forbidden_calls_stop_the_vmm_with_a_report";
    const ALLOWED_WORKED: &str = "the VMM's calls worked under the filter";

    /// (name, call number reported) of the forbidden calls, each made by one child.
    /// `None`: the call is made with every signal blocked (posix_spawn does that), so
    /// the kernel kills the process with SIGSYS instead of letting it report.
    const FORBIDDEN: &[(&str, Option<i64>)] = &[
        ("open a network socket", Some(libc::SYS_socket)),
        ("fork", Some(libc::SYS_clone)),
        ("run a program", None),
        ("signal another process", Some(libc::SYS_tgkill)),
        ("map executable memory", Some(libc::SYS_mmap)),
        // Review: the rules below had no test; allowing each call whatever its
        // arguments left this test passing.
        ("make memory executable", Some(libc::SYS_mprotect)),
        ("an ioctl that is not KVM's", Some(libc::SYS_ioctl)),
        ("look up a path's metadata", Some(libc::SYS_newfstatat)),
        ("a prctl other than a thread's name", Some(libc::SYS_prctl)),
    ];

    #[test]
    fn forbidden_calls_stop_the_vmm_with_a_report() {
        if let (Ok(call), Some(dir)) = (std::env::var(CHILD_ENV), std::env::var_os(CHILD_DIR_ENV)) {
            run_under_the_filter(&call, std::path::Path::new(&dir));
        }
        for (call, number) in FORBIDDEN {
            let dir = tempfile::tempdir().unwrap();
            let child = Command::new(std::env::current_exe().unwrap())
                .args([THIS_TEST, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, call)
                .env(CHILD_DIR_ENV, dir.path())
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&child.stdout);
            let context = format!(
                "{call}: {:?}\n{stdout}\n{}",
                child.status,
                String::from_utf8_lossy(&child.stderr)
            );
            assert!(stdout.contains(ALLOWED_WORKED), "{context}");
            let Some(number) = number else {
                assert_eq!(child.status.signal(), Some(libc::SIGSYS), "{context}");
                continue;
            };
            let report = stdout
                .lines()
                .find_map(|line| serde_json::from_str::<Outcome>(line).ok())
                .unwrap_or_else(|| panic!("no outcome reported: {context}"));
            let error = report.error().unwrap_or_default();
            assert!(
                error.contains(&format!("number {number} on x86_64")),
                "{context}"
            );
            assert_eq!(child.status.code(), Some(1), "{context}");
        }
    }

    /// In the child: what the VMM does while the VM runs must work (its socket in
    /// `dir`); then `call` must stop the process before it returns.
    fn run_under_the_filter(call: &str, dir: &std::path::Path) -> ! {
        let socket = dir.join("vsock.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        install(Some(libc::STDOUT_FILENO)).unwrap();

        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let worker = std::thread::spawn(move || {
            event.write(1).unwrap();
            event.read().unwrap()
        });
        assert_eq!(worker.join().unwrap(), 1);
        let mut client = UnixStream::connect(&socket).unwrap();
        client.set_nonblocking(true).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(b"ping").unwrap();
        let mut received = [0u8; 4];
        server.read_exact(&mut received).unwrap();
        assert_eq!(&received, b"ping");
        // SAFETY: a null argument of size 0: the call checks it and returns.
        let clone3 = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0) };
        let clone3_error = std::io::Error::last_os_error().raw_os_error();
        assert_eq!((clone3, clone3_error), (-1, Some(libc::ENOSYS)));
        let open_error = std::fs::File::open("/etc/hostname").map(drop);
        assert_eq!(
            open_error.map_err(|e| e.raw_os_error()),
            Err(Some(libc::EACCES))
        );
        shrink_a_threads_heap();
        // Signals by descriptor are refused; the rest of fcntl works.
        let fd = client.as_raw_fd();
        for (command, argument) in [
            (libc::F_SETOWN, 1),
            (F_SETSIG, libc::SIGKILL),
            (libc::F_SETFL, libc::O_ASYNC | libc::O_NONBLOCK),
        ] {
            // SAFETY: fcntl on a socket this process holds, with int arguments.
            let refused = unsafe { libc::fcntl(fd, command, argument) };
            let error = std::io::Error::last_os_error().raw_os_error();
            assert_eq!((refused, error), (-1, Some(libc::EPERM)), "{command}");
        }
        // SAFETY: as above.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) }, 0);
        println!("{ALLOWED_WORKED}");

        match call {
            "open a file" => drop(std::fs::File::open("/etc/hostname")),
            "open a network socket" => drop(std::net::TcpListener::bind("127.0.0.1:0")),
            // SAFETY: clone as fork(2) makes it; were it allowed, both processes would
            // go on to the line below and the test would fail.
            "fork" => unsafe {
                libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0);
            },
            "run a program" => drop(Command::new("true").status()),
            // SAFETY: signal 0 (to init) only checks that the process exists.
            "signal another process" => unsafe {
                libc::syscall(libc::SYS_tgkill, 1, 1, 0);
            },
            // SAFETY: a fresh anonymous mapping, unused and never unmapped here.
            "map executable memory" => unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
            },
            // SAFETY: a fresh anonymous mapping of this child's, made executable.
            "make memory executable" => unsafe {
                let page = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(page, libc::MAP_FAILED);
                libc::mprotect(page, 4096, libc::PROT_READ | libc::PROT_EXEC);
            },
            // SAFETY: FIONREAD on stdin into a local int.
            "an ioctl that is not KVM's" => unsafe {
                let mut n: c_int = 0;
                libc::ioctl(0, libc::FIONREAD, &mut n);
            },
            // SAFETY: a stat of a path into a local buffer.
            "look up a path's metadata" => unsafe {
                let mut stat: libc::stat = std::mem::zeroed();
                libc::syscall(
                    libc::SYS_newfstatat,
                    libc::AT_FDCWD,
                    c"/etc/hostname".as_ptr(),
                    &mut stat,
                    0,
                );
            },
            // SAFETY: PR_GET_DUMPABLE only reads a flag.
            "a prctl other than a thread's name" => unsafe {
                libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0);
            },
            other => panic!("unknown call {other:?}"),
        }
        println!("not stopped by {call}");
        std::process::exit(0)
    }

    /// What a guest streaming to a reader that went away makes the vsock worker do:
    /// fill its thread's heap with buffered data, then free it at once. glibc then
    /// shrinks that heap, and the first time it does, it opens
    /// /proc/sys/vm/overcommit_memory (which once stopped the VMM).
    fn shrink_a_threads_heap() {
        std::thread::spawn(|| {
            let blocks: Vec<Vec<u8>> = (0..64u8).map(|n| vec![n; 64 << 10]).collect();
            let total: usize = blocks.iter().map(|block| block[0] as usize).sum();
            drop(blocks);
            total
        })
        .join()
        .unwrap();
    }

    #[test]
    fn numbers_are_written_without_allocating() {
        let mut buffer = [0u8; 12];
        for value in [0, 7, 257, -1, c_int::MAX, c_int::MIN] {
            assert_eq!(decimal(value, &mut buffer), value.to_string().as_bytes());
        }
    }

    #[test]
    fn the_switch_is_on_unless_turned_off() {
        assert!(switch(None).unwrap() && switch(Some("on")).unwrap());
        assert!(!switch(Some("off")).unwrap());
        assert!(matches!(
            switch(Some("no")),
            Err(SeccompError::BadSwitch(value)) if value == "no"
        ));
    }
}
