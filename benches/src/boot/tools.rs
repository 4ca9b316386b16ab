//! The programs and images the benchmark runs, found or built.

use std::fs;
use std::path::{Path, PathBuf};

use vm_tests::try_build_artifact;
pub(super) use vm_tests::workspace_root;

use crate::workspace::GuestArtifacts;

use super::args::Args;
use super::say;

/// The programs and images the benchmark runs.
#[derive(Debug, Clone)]
pub(super) struct Tools {
    pub(super) kernel: PathBuf,
    pub(super) initrd: PathBuf,
    pub(super) vmctl: PathBuf,
    pub(super) qemu: PathBuf,
    /// The workspace VM's agent initramfs and root image.
    pub(super) agent_initrd: PathBuf,
    pub(super) rootfs: PathBuf,
}

impl Tools {
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
            qemu: "/q".into(),
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
    let qemu = match &args.qemu {
        Some(q) => q.clone(),
        None => find_in_path("qemu-system-x86_64").ok_or(
            "qemu-system-x86_64 is not in PATH (apt-get install qemu-system-x86): the benchmark \
             compares against QEMU's microvm",
        )?,
    };
    let abs = |p: PathBuf| {
        p.canonicalize()
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    Ok(Tools {
        kernel: abs(kernel)?,
        initrd: abs(initrd)?,
        vmctl: abs(vmctl)?,
        qemu: abs(qemu)?,
        agent_initrd: abs(agent_initrd)?,
        rootfs: abs(rootfs)?,
    })
}
