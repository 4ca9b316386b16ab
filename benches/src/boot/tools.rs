//! The programs and images the benchmark runs, found or built.

use std::fs;
use std::path::{Path, PathBuf};

use vm_tests::try_build_artifact;
pub(super) use vm_tests::workspace_root;

use crate::sections::Section;
use crate::workspace::GuestArtifacts;

use super::args::Args;
use super::say;

/// The programs and images the benchmark runs.
#[derive(Debug, Clone)]
pub(super) struct Tools {
    pub(super) kernel: PathBuf,
    pub(super) initrd: PathBuf,
    pub(super) vmctl: PathBuf,
    /// Needed by the sections that compare against QEMU ([`qemu_needed_by`]); the
    /// others run without it.
    pub(super) qemu: Option<PathBuf>,
    /// The workspace VM's agent initramfs and root image.
    pub(super) agent_initrd: PathBuf,
    pub(super) rootfs: PathBuf,
}

/// QEMU's program, looked up in PATH without `--qemu`.
pub(super) const QEMU_PROGRAM: &str = "qemu-system-x86_64";
/// Why there is no QEMU, and how to get one.
pub(super) const QEMU_MISSING: &str = "qemu-system-x86_64 is not in PATH (apt-get install \
qemu-system-x86, or --qemu PATH)";

/// The sections among `sections` that boot QEMU's microvm as the peer of ours: the
/// benchmark needs QEMU for them (virtio-fs's comparison by VMM is left out without).
pub(super) fn qemu_needed_by(sections: &[Section]) -> Vec<Section> {
    sections
        .iter()
        .copied()
        .filter(|s| matches!(s, Section::Boot | Section::Churn))
        .collect()
}

impl Tools {
    /// The VMMs this run can boot: ours, and QEMU's where it was found.
    pub(super) fn vmms(&self) -> Vec<super::Vmm> {
        let mut vmms = vec![super::Vmm::Ours];
        if self.qemu.is_some() {
            vmms.push(super::Vmm::Qemu);
        }
        vmms
    }

    /// What the workspace-VM sections run: vmctl and the guest it boots.
    pub(super) fn guest_artifacts(&self) -> GuestArtifacts {
        GuestArtifacts {
            vmctl: self.vmctl.clone(),
            kernel: self.kernel.clone(),
            agent_initramfs: self.agent_initrd.clone(),
            rootfs: self.rootfs.clone(),
        }
    }
}

#[cfg(test)]
impl Tools {
    /// Short made-up paths, for tests of the command lines.
    pub(super) fn fake() -> Tools {
        Tools {
            kernel: "/k".into(),
            initrd: "/i".into(),
            vmctl: "/v".into(),
            qemu: Some("/q".into()),
            agent_initrd: "/a".into(),
            rootfs: "/r".into(),
        }
    }
}

pub(super) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target"),
    }
}

pub(super) fn find_in_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

pub(super) fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for e in fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        let t = if p.is_dir() {
            newest_mtime(&p)
        } else {
            e.metadata().ok()?.modified().ok()
        };
        newest = newest.max(t);
    }
    newest
}

pub(super) fn resolve_tools(args: &Args) -> Result<Tools, String> {
    let kernel = match &args.kernel {
        Some(k) => k.clone(),
        None => try_build_artifact("kernel-config/build.sh", &["guest"])?,
    };
    let initrd = match &args.initrd {
        Some(i) => i.clone(),
        None => try_build_artifact("rootfs/build-initramfs.sh", &[])?,
    };
    // The scripts vmctl up would run; cached builds make them quick.
    let agent_initrd = match &args.agent_initrd {
        Some(i) => i.clone(),
        None => try_build_artifact("guest-agent/build-initramfs.sh", &[])?,
    };
    let rootfs = match &args.rootfs {
        Some(r) => r.clone(),
        None => try_build_artifact("rootfs/build-rootfs.sh", &[])?,
    };
    let vmctl = match (&args.vmctl, std::env::var_os("VMCTL_BIN")) {
        (Some(v), _) => v.clone(),
        (None, Some(v)) => PathBuf::from(v),
        (None, None) => target_dir().join("release").join("vmctl"),
    };
    if !vmctl.is_file() {
        return Err(format!(
            "{} does not exist: build it first with 'cargo build --release -p vmctl' \
             (cargo bench does not build other packages' binaries)",
            vmctl.display()
        ));
    }
    // A stale vmctl would benchmark old code (or lack nested-exec): say so loudly.
    if let Ok(built) = fs::metadata(&vmctl).and_then(|m| m.modified()) {
        let ws = workspace_root();
        let newest = [
            ws.join("vmm/src"),
            ws.join("vmctl/src"),
            ws.join("guest-agent/src"),
        ]
        .iter()
        .filter_map(|d| newest_mtime(d))
        .max();
        if newest.is_some_and(|n| n > built) {
            say(format!(
                "warning: {} is older than the vmm/vmctl/guest-agent sources; run 'cargo build --release -p vmctl' \
                 to benchmark the current code",
                vmctl.display()
            ));
        }
    }
    let qemu = args.qemu.clone().or_else(|| find_in_path(QEMU_PROGRAM));
    let needed_by = qemu_needed_by(&args.sections);
    if qemu.is_none() && !needed_by.is_empty() {
        return Err(format!(
            "{QEMU_MISSING}: the sections {} compare against QEMU's microvm (--only without \
             them runs without QEMU)",
            crate::sections::join(&needed_by, ", ")
        ));
    }
    let abs = |p: PathBuf| {
        p.canonicalize()
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    Ok(Tools {
        kernel: abs(kernel)?,
        initrd: abs(initrd)?,
        vmctl: abs(vmctl)?,
        qemu: qemu.map(abs).transpose()?,
        agent_initrd: abs(agent_initrd)?,
        rootfs: abs(rootfs)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_sections_against_qemu_need_it() {
        assert_eq!(
            qemu_needed_by(&Section::ALL),
            [Section::Boot, Section::Churn]
        );
        assert!(qemu_needed_by(&[Section::Fs]).is_empty());
        assert!(qemu_needed_by(&[Section::Workspace, Section::Egress, Section::Agent]).is_empty());
        let tools = Tools {
            qemu: None,
            ..Tools::fake()
        };
        assert_eq!(tools.vmms(), [super::super::Vmm::Ours]);
        assert_eq!(
            Tools::fake().vmms(),
            [super::super::Vmm::Ours, super::super::Vmm::Qemu]
        );
    }
}
