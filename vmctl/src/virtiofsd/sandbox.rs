//! The choice of virtiofsd's sandbox: the namespace sandbox wherever this user may
//! make one, else none, or what [`SANDBOX_ENV`] asks.

use super::daemon::Sandbox;
use super::VirtiofsdError;

const NO_SANDBOX_WARNING: &str = "vmctl: warning: virtiofsd runs without its sandbox because \
     user namespaces are unavailable to this user: a guest that exploits symlink races could \
     reach host files outside its shares";

const NO_SANDBOX_ASKED_WARNING: &str = "vmctl: warning: virtiofsd runs without its sandbox, as \
     VMCTL_VIRTIOFSD_SANDBOX=none asks: a guest that exploits symlink races could reach host \
     files outside its shares";

/// Chooses virtiofsd's sandbox: `namespace` (the default: the namespace sandbox
/// wherever this user may have one) or `none`, for a host where the namespace sandbox
/// fails although user namespaces are there (a container, an AppArmor rule).
pub const SANDBOX_ENV: &str = "VMCTL_VIRTIOFSD_SANDBOX";

const SANDBOX_HINT: &str = "\n(if it is virtiofsd's namespace sandbox that cannot work on \
     this host, VMCTL_VIRTIOFSD_SANDBOX=none runs it without one, which is less safe: see the \
     README's \"Workspace files (virtio-fs)\")";

/// The sandbox for this start's daemons, and what to add to the error of one that
/// fails to start in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SandboxChoice {
    pub(super) sandbox: Sandbox,
    pub(super) hint: String,
}

/// What this user may do with the namespaces virtiofsd's sandbox makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Namespaces {
    /// A user namespace, and mount, PID and network namespaces inside it.
    Available,
    /// No user namespace at all (`kernel.unprivileged_userns_clone=0`,
    /// `user.max_user_namespaces=0`).
    NoUserNamespace,
    /// A user namespace, but none of the others inside it (the errno): what Ubuntu's
    /// `kernel.apparmor_restrict_unprivileged_userns=1` does to a program without an
    /// AppArmor profile that allows it. virtiofsd may have such a profile (vmctl, which
    /// probed, may not), so its sandbox is still tried.
    RestrictedInside(i32),
    /// The probe failed for a reason of its own (no process to spare).
    Unknown,
}

/// The sandbox for this start's daemons: the namespace sandbox, unless [`SANDBOX_ENV`]
/// says none or this user cannot make a user namespace at all. Decided once, before
/// any daemon starts: a daemon that fails in its sandbox is an error, never a reason
/// to try again without (a guest can make a start fail, by moving a directory on a
/// share's path at the right moment). `probe` is asked only when it matters.
pub(super) fn choose_sandbox(
    is_root: bool,
    asked: Option<&str>,
    probe: impl FnOnce() -> Namespaces,
) -> Result<SandboxChoice, VirtiofsdError> {
    let namespace = |hint: String| SandboxChoice {
        sandbox: Sandbox::Namespace,
        hint,
    };
    match asked.map(str::trim) {
        None | Some("" | "namespace") => {}
        Some("none") => {
            vmm::to_stderr!("{NO_SANDBOX_ASKED_WARNING}");
            return Ok(SandboxChoice {
                sandbox: Sandbox::None,
                hint: String::new(),
            });
        }
        Some(value) => {
            return Err(VirtiofsdError::BadSandbox {
                value: value.to_string(),
            })
        }
    }
    if is_root {
        return Ok(namespace(SANDBOX_HINT.into()));
    }
    match probe() {
        Namespaces::Available | Namespaces::Unknown => Ok(namespace(SANDBOX_HINT.into())),
        Namespaces::RestrictedInside(errno) => Ok(namespace(restricted_hint(errno))),
        Namespaces::NoUserNamespace => {
            vmm::to_stderr!("{NO_SANDBOX_WARNING}");
            Ok(SandboxChoice {
                sandbox: Sandbox::None,
                hint: String::new(),
            })
        }
    }
}

/// Why a daemon failed in its sandbox where this user may make a user namespace but
/// nothing inside it, and the two ways out.
fn restricted_hint(errno: i32) -> String {
    format!(
        "\n(this user may make a user namespace, but not the mount, PID and network \
         namespaces virtiofsd's sandbox makes inside it: {}. On Ubuntu 23.10 and later \
         AppArmor does this (kernel.apparmor_restrict_unprivileged_userns=1). Either give \
         virtiofsd an AppArmor profile that allows user namespaces (the README's \
         \"Workspace files (virtio-fs)\" shows one), or set {SANDBOX_ENV}=none to run it \
         without its sandbox, which is less safe)",
        std::io::Error::from_raw_os_error(errno)
    )
}

/// What this user may do with namespaces: a user namespace, then the namespaces
/// virtiofsd makes inside one, each tried in a child (a threaded process may not make
/// a user namespace). Only a refusal by the kernel says no.
pub(super) fn probe_namespaces() -> Namespaces {
    const INSIDE: libc::c_int = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET;
    match unshare_in_child(&[libc::CLONE_NEWUSER]) {
        Ok(()) => {}
        Err(e) if refuses_namespaces(&e) => return Namespaces::NoUserNamespace,
        Err(_) => return Namespaces::Unknown,
    }
    match unshare_in_child(&[libc::CLONE_NEWUSER, INSIDE]) {
        Ok(()) => Namespaces::Available,
        Err(e) if refuses_namespaces(&e) => {
            Namespaces::RestrictedInside(e.raw_os_error().unwrap_or(libc::EPERM))
        }
        Err(_) => Namespaces::Unknown,
    }
}

/// Runs `/bin/true` after unsharing each of `steps` in turn; the error of the first
/// step refused.
fn unshare_in_child(steps: &'static [libc::c_int]) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let mut probe = std::process::Command::new("/bin/true");
    probe
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // unshare, which is async-signal-safe.
    unsafe {
        probe.pre_exec(move || {
            for &flags in steps {
                if libc::unshare(flags) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    match probe.status() {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::info!("probing for namespaces ({steps:#x?}): {e}");
            Err(e)
        }
    }
}

/// Whether `error` (from unshare) is the kernel refusing the namespaces, rather than
/// the probe failing for a reason of its own.
fn refuses_namespaces(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EPERM | libc::EINVAL | libc::ENOSPC | libc::EUSERS | libc::EACCES)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the kernel's refusal of the namespaces means none; a probe that could not
    /// run (no process to spare, no /bin/true) leaves the sandbox on.
    #[test]
    fn only_a_refusal_of_the_namespaces_drops_the_sandbox() {
        let errno = std::io::Error::from_raw_os_error;
        for refusal in [libc::EPERM, libc::EINVAL, libc::ENOSPC, libc::EUSERS] {
            assert!(refuses_namespaces(&errno(refusal)), "{refusal}");
        }
        for other in [libc::EAGAIN, libc::ENOMEM, libc::ENOENT] {
            assert!(!refuses_namespaces(&errno(other)), "{other}");
        }
        // This test runs where namespaces work (as root, or with user namespaces).
        assert_eq!(probe_namespaces(), Namespaces::Available);
    }

    /// Where a user namespace can be made but nothing inside it (Ubuntu's AppArmor
    /// restriction), the sandbox is kept: virtiofsd may have a profile that lets it
    /// work, and if not, its failure says why and what to do. Only where there are no
    /// user namespaces at all does virtiofsd run without, saying so.
    #[test]
    fn a_user_namespace_restricted_inside_keeps_the_sandbox_and_explains_its_failure() {
        let choose = |is_root, probed| choose_sandbox(is_root, None, || probed).unwrap();
        let restricted = choose(false, Namespaces::RestrictedInside(libc::EPERM));
        assert_eq!(restricted.sandbox, Sandbox::Namespace);
        for needed in [
            "apparmor_restrict_unprivileged_userns",
            "AppArmor profile",
            "VMCTL_VIRTIOFSD_SANDBOX=none",
            &std::io::Error::from_raw_os_error(libc::EPERM).to_string(),
        ] {
            assert!(
                restricted.hint.contains(needed),
                "{needed}: {}",
                restricted.hint
            );
        }
        for probed in [Namespaces::Available, Namespaces::Unknown] {
            assert_eq!(choose(false, probed).sandbox, Sandbox::Namespace);
            assert_eq!(choose(false, probed).hint, SANDBOX_HINT);
        }
        assert_eq!(
            choose(false, Namespaces::NoUserNamespace).sandbox,
            Sandbox::None
        );
        assert_eq!(
            choose(true, Namespaces::NoUserNamespace).sandbox,
            Sandbox::Namespace,
            "root needs no user namespace"
        );
        let asked_none = choose_sandbox(false, Some("none"), || {
            panic!("probed although the sandbox was turned off")
        });
        assert_eq!(asked_none.unwrap().sandbox, Sandbox::None);
        // The daemon's failure in its sandbox carries the explanation.
        let error = VirtiofsdError::Exited {
            host: "/w".into(),
            status: "exit status: 1".into(),
            log: "/l".into(),
            tail: "  Error entering sandbox: Unshare(Os { code: 1 })".into(),
            hint: restricted.hint,
        }
        .to_string();
        assert!(
            error.contains("Unshare") && error.contains("apparmor_restrict"),
            "{error}"
        );
    }
}
