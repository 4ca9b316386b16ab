//! Can this host's /dev/kvm boot a standard Linux guest?

use std::path::Path;

/// What kind of KVM the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvmKind {
    /// Hardware virtualization (`kvm_intel` or `kvm_amd`): boots Linux directly.
    Hardware(&'static str),
    /// PVM (`kvm_pvm`): emulates guest kernel mode only partly; Linux does not boot.
    Pvm,
    /// The `kvm` module without a hardware backend.
    NoBackend,
    /// No KVM at all.
    Absent,
}

impl KvmKind {
    pub fn detect() -> Self {
        Self::detect_in(Path::new("/sys/module"))
    }

    fn detect_in(modules: &Path) -> Self {
        let loaded = |name: &str| modules.join(name).exists();
        if loaded("kvm_intel") {
            Self::Hardware("kvm_intel")
        } else if loaded("kvm_amd") {
            Self::Hardware("kvm_amd")
        } else if loaded("kvm_pvm") {
            Self::Pvm
        } else if loaded("kvm") {
            Self::NoBackend
        } else {
            Self::Absent
        }
    }

    pub fn boots_linux(self) -> bool {
        matches!(self, Self::Hardware(_))
    }

    /// The one line vmctl prints on stderr when it runs a VM in the nested host.
    pub fn announce_nested(self) {
        vmm::to_stderr!(
            "vmctl: {}; running the VM inside a QEMU-TCG nested host (slower; see README)",
            self.why_nested()
        );
    }

    /// Why a nested host is needed, for the one line vmctl prints.
    pub fn why_nested(self) -> &'static str {
        match self {
            Self::Hardware(_) => "requested with --nested always",
            Self::Pvm => {
                "this host's KVM is PVM (kvm_pvm), which cannot boot a standard Linux guest"
            }
            Self::NoBackend => "this host's KVM has no hardware backend (no kvm_intel or kvm_amd)",
            Self::Absent => "this host has no KVM",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for /sys/module holding `names`.
    fn modules(names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for name in names {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
        }
        dir
    }

    #[test]
    fn hardware_kvm_is_preferred() {
        assert_eq!(
            KvmKind::detect_in(modules(&["kvm", "kvm_amd"]).path()),
            KvmKind::Hardware("kvm_amd")
        );
        assert_eq!(
            KvmKind::detect_in(modules(&["kvm", "kvm_intel"]).path()),
            KvmKind::Hardware("kvm_intel")
        );
        assert!(KvmKind::Hardware("kvm_intel").boots_linux());
    }

    #[test]
    fn pvm_and_absent_need_the_nested_host() {
        let pvm = KvmKind::detect_in(modules(&["kvm", "kvm_pvm"]).path());
        assert_eq!(pvm, KvmKind::Pvm);
        assert!(!pvm.boots_linux());
        assert!(pvm.why_nested().contains("PVM"));
        assert_eq!(
            KvmKind::detect_in(modules(&["kvm"]).path()),
            KvmKind::NoBackend
        );
        assert_eq!(KvmKind::detect_in(modules(&[]).path()), KvmKind::Absent);
    }
}
