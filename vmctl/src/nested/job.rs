//! The job the outer vmctl hands to the nested host, and the status it gets back.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vmm::config::{DiskConfig, VmConfig};

/// Where the nested host mounts the job directory.
pub const GUEST_JOB_DIR: &str = "/run/vmctl-job";
pub const SPEC_FILE: &str = "spec.json";
/// Kernel argument (passed to init as an environment variable) naming the job file.
pub const JOB_ENV: &str = "VMCTL_NESTED_JOB";
pub const STATUS_FILE: &str = "status.json";
/// 9p mount tags.
pub const ROOT_TAG: &str = "hostroot";
pub const JOB_TAG: &str = "vmctljob";

pub fn writable_dir_tag(index: usize) -> String {
    format!("vmctlrw{index}")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disk {
    pub path: PathBuf,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NestedJob {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub disks: Vec<Disk>,
    pub extra_cmdline: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub report_boot_time: bool,
    /// Host directories shared read-write (those holding writable disks), mounted at
    /// the same path, in the order of their tags (`writable_dir_tag`).
    pub writable_dirs: Vec<PathBuf>,
}

impl NestedJob {
    pub fn new(config: &VmConfig, report_boot_time: bool) -> Self {
        let mut writable_dirs: Vec<PathBuf> = config
            .disks
            .iter()
            .filter(|d| !d.read_only)
            .filter_map(|d| d.path.canonicalize().ok()?.parent().map(PathBuf::from))
            .collect();
        // Parents before children, so a child mount is not hidden by its parent's.
        writable_dirs.sort_by_key(|d| d.components().count());
        writable_dirs.dedup();
        Self {
            kernel: config.kernel.clone(),
            initrd: config.initrd.clone(),
            disks: config
                .disks
                .iter()
                .map(|d| Disk {
                    path: d.path.clone(),
                    read_only: d.read_only,
                })
                .collect(),
            extra_cmdline: config.extra_cmdline.clone(),
            vcpus: config.vcpus,
            memory_mib: config.memory_mib,
            report_boot_time,
            writable_dirs,
        }
    }

    pub fn vm_config(&self) -> VmConfig {
        let mut config = VmConfig::new(self.kernel.clone());
        config.initrd = self.initrd.clone();
        config.disks = self
            .disks
            .iter()
            .map(|d| DiskConfig {
                path: d.path.clone(),
                read_only: d.read_only,
            })
            .collect();
        config.extra_cmdline = self.extra_cmdline.clone();
        config.vcpus = self.vcpus;
        config.memory_mib = self.memory_mib;
        config
    }
}

/// Written by the nested host's init just before it resets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NestedStatus {
    pub exit_code: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_round_trips_the_vm_config() {
        let dir = std::env::temp_dir().join(format!("vmctl-job-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for name in ["a.img", "sub/b.img", "ro.img"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let mut config = VmConfig::new("/k".into());
        config.initrd = Some("/i".into());
        config.extra_cmdline = "loglevel=7".into();
        config.vcpus = 2;
        config.memory_mib = 512;
        config.disks = vec![
            DiskConfig::parse(dir.join("sub/b.img").to_str().unwrap()),
            DiskConfig::parse(dir.join("a.img").to_str().unwrap()),
            DiskConfig::parse(&format!("{}:ro", dir.join("ro.img").display())),
        ];
        let job = NestedJob::new(&config, true);
        let text = serde_json::to_string(&job).unwrap();
        let back: NestedJob = serde_json::from_str(&text).unwrap();
        assert_eq!(back.vm_config(), config);
        let dir = dir.canonicalize().unwrap();
        assert_eq!(back.writable_dirs, vec![dir.clone(), dir.join("sub")]);
    }
}
