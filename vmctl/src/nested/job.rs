//! The job the outer vmctl hands to the nested host, and the status it gets back.

use std::ffi::OsString;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vmm::config::{DiskConfig, VmConfig};

use crate::shares::ShareSet;

/// Where the nested host mounts the job directory.
pub const GUEST_JOB_DIR: &str = "/run/vmctl-job";
pub const SPEC_FILE: &str = "spec.json";
/// Kernel argument (passed to init as an environment variable) naming the job file.
pub const JOB_ENV: &str = "VMCTL_NESTED_JOB";
pub const STATUS_FILE: &str = "status.json";
/// 9p mount tags.
pub const ROOT_TAG: &str = "hostroot";
pub const JOB_TAG: &str = "vmctljob";

pub fn shared_dir_tag(index: usize) -> String {
    format!("vmctlrw{index}")
}

/// A host directory the nested host mounts at the same path over its own 9p device
/// (uncached, unlike the root, so host-side changes show at once).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedDir {
    pub path: PathBuf,
    pub read_only: bool,
}

/// A host directory the nested host mounts over virtio-fs, from a virtiofsd on the
/// host: the VM's shares, which the nested host's own virtiofsd serves on to the VM.
/// (Over 9p a file loses its identity when the name it was opened by goes away, e.g.
/// after a hard link and an unlink, which git does for every object it writes.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsDir {
    pub tag: String,
    pub path: PathBuf,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disk {
    pub path: PathBuf,
    pub read_only: bool,
}

/// What the nested host runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Work {
    /// Our VMM, booting this VM.
    Vm(VmJob),
    /// Any command (benchmarks, debugging), with stdout on the host's stdout.
    Command(CommandJob),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmJob {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub disks: Vec<Disk>,
    pub extra_cmdline: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub report_boot_time: bool,
    /// A vsock device whose hybrid socket, inside the nested host, the host reaches
    /// through the multiplexed link (see `mux`).
    pub vsock: bool,
    /// Directory shares, each served by a virtiofsd inside the nested host.
    pub shares: Option<ShareSet>,
    /// The guest hands back the memory it frees (the VMM's balloon), and the nested
    /// host the memory that frees in turn (QEMU's).
    pub free_page_reporting: bool,
    /// The guest has a virtio console beside its serial one.
    pub virtio_console: bool,
    /// The VMM's switches as the host's environment sets them (`VMCTL_SECCOMP`): the
    /// nested host's VMM gets them too.
    #[serde(default)]
    pub vmm_env: Vec<(String, String)>,
}

/// The environment variables of the host's that the nested host passes on to the VMM.
const VMM_ENV: &[&str] = &[vmm::process::SECCOMP_SWITCH_ENV];

/// What a VM job's VMM gets of the host's environment (`lookup`): the switches of
/// `VMM_ENV`. Never `VMCTL_VCPU_CPUS`, whose CPUs are the host's: they hold the whole
/// nested host (launcher.rs), and inside it the nested host's init chooses (init.rs).
pub fn vmm_env(lookup: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    VMM_ENV
        .iter()
        .filter_map(|name| Some((name.to_string(), lookup(name)?)))
        .collect()
}

/// What a command job runs with of the host's environment `vars`: all of it but
/// `VMCTL_VCPU_CPUS` (as in [`vmm_env`]), and but what is not UTF-8, which the job
/// (JSON) cannot carry: such a variable is left out with a warning.
pub fn command_env(vars: impl Iterator<Item = (OsString, OsString)>) -> Vec<(String, String)> {
    vars.filter_map(
        |(name, value)| match (name.into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => Some((name, value)),
            (name, _) => {
                tracing::warn!(
                    "{}: not UTF-8; the nested host's command runs without it",
                    name.unwrap_or_else(|name| name.to_string_lossy().into_owned())
                );
                None
            }
        },
    )
    .filter(|(name, _)| name != vmm::process::VCPU_CPUS_ENV)
    .collect()
}

/// Where the VM's hybrid-vsock socket lives inside the nested host: a directory of its
/// own, the one the VMM's jail shows it (not the virtiofsd sockets beside it).
pub const GUEST_VSOCK_SOCKET: &str = "/run/vmctl/vsock/vsock.sock";
/// Name of the nested host's virtio-serial port that carries the multiplexed link.
pub const MUX_PORT_NAME: &str = "vmctl.mux";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandJob {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NestedJob {
    pub work: Work,
    /// The nested host's own size.
    pub host_vcpus: u32,
    pub host_memory_mib: u64,
    /// Host directories mounted at the same path, parents first, in the order of
    /// their tags (`shared_dir_tag`).
    pub shared_dirs: Vec<SharedDir>,
    /// Host directories mounted at the same path over virtio-fs, after `shared_dirs`,
    /// parents first.
    pub fs_dirs: Vec<FsDir>,
}

/// Memory the nested host needs besides a guest's: its kernel, vmctl, page tables.
const NESTED_HOST_OVERHEAD_MIB: u64 = 256;

impl NestedJob {
    /// Whether the nested host needs the multiplexed link to the host.
    pub fn needs_mux(&self) -> bool {
        matches!(&self.work, Work::Vm(vm) if vm.vsock)
    }

    /// Whether the nested host hands back the memory it frees: as its VM does. A
    /// command's nested host (benchmarks, tests) lives for that command: it does
    /// without, and without the reports' work and interrupts in its first seconds,
    /// which the stall watch's samples of a healthy nested host would catch.
    pub fn free_page_reporting(&self) -> bool {
        match &self.work {
            Work::Vm(vm) => vm.free_page_reporting,
            Work::Command(_) => false,
        }
    }

    /// A job that boots `config` with `shares`; directories holding writable disks
    /// and the shares' directories are mounted so the guest's writes reach the
    /// host's files.
    pub fn for_vm(config: &VmConfig, shares: Option<&ShareSet>, report_boot_time: bool) -> Self {
        let disk_dirs = config
            .disks
            .iter()
            .filter(|d| !d.read_only)
            .filter_map(|d| d.path.canonicalize().ok()?.parent().map(PathBuf::from))
            .map(|path| SharedDir {
                path,
                read_only: false,
            });
        // The nested host records a dying virtiofsd where the host can see it.
        let failure_dir = shares
            .and_then(|set| set.failure_file.as_ref()?.parent())
            .map(|dir| SharedDir {
                path: dir.to_path_buf(),
                read_only: false,
            });
        let shared_dirs = mount_order(disk_dirs.chain(failure_dir));
        let fs_dirs = shares
            .map(|set| {
                nested_host_shares(set)
                    .into_iter()
                    .enumerate()
                    .map(|(index, share)| FsDir {
                        tag: crate::shares::tag(index),
                        path: share.host,
                        read_only: share.read_only,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            work: Work::Vm(VmJob {
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
                vsock: config.vsock.is_some(),
                shares: shares.cloned(),
                free_page_reporting: config.free_page_reporting,
                virtio_console: config.virtio_console,
                vmm_env: vmm_env(|name| std::env::var(name).ok()),
            }),
            // One more than the guest's: its vCPUs run on all but CPU 0 (init.rs).
            host_vcpus: config.vcpus.saturating_add(1),
            host_memory_mib: config.memory_mib + NESTED_HOST_OVERHEAD_MIB,
            shared_dirs,
            fs_dirs,
        }
    }

    /// A job that runs `command` with `writable` directories shared read-write.
    pub fn for_command(
        command: CommandJob,
        vcpus: u32,
        memory_mib: u64,
        writable: &[PathBuf],
    ) -> Self {
        Self {
            work: Work::Command(command),
            host_vcpus: vcpus,
            host_memory_mib: memory_mib,
            shared_dirs: mount_order(writable.iter().filter_map(|d| {
                Some(SharedDir {
                    path: d.canonicalize().ok()?,
                    read_only: false,
                })
            })),
            fs_dirs: Vec::new(),
        }
    }
}

/// The directories the nested host itself must share from the host so that it can
/// serve `set` to the VM: each share's host directory once (read-write if any share
/// of it writes), at its own path, parents first. The host's virtiofsd for share `i`
/// gets tag `shares::tag(i)`.
pub fn nested_host_shares(set: &ShareSet) -> Vec<crate::shares::Share> {
    let dirs = set.shares.iter().map(|share| SharedDir {
        path: share.host.clone(),
        read_only: share.read_only,
    });
    mount_order(dirs)
        .into_iter()
        .map(|dir| crate::shares::Share {
            host: dir.path.clone(),
            guest: dir.path,
            read_only: dir.read_only,
        })
        .collect()
}

/// Directories in mount order: parents before children (so a child mount is not
/// hidden by its parent's), each once (read-write if any use of it writes).
fn mount_order(dirs: impl Iterator<Item = SharedDir>) -> Vec<SharedDir> {
    let mut unique: Vec<SharedDir> = Vec::new();
    for dir in dirs {
        match unique.iter_mut().find(|d| d.path == dir.path) {
            Some(known) => known.read_only &= dir.read_only,
            None => unique.push(dir),
        }
    }
    unique.sort_by_key(|d| d.path.components().count());
    unique
}

impl VmJob {
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
        config.free_page_reporting = self.free_page_reporting;
        config.virtio_console = self.virtio_console;
        if self.vsock {
            config.vsock = Some(vmm::config::VsockConfig {
                guest_cid: vmm::devices::virtio::vsock::DEFAULT_GUEST_CID,
                uds_path: PathBuf::from(GUEST_VSOCK_SOCKET),
            });
        }
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
    fn the_host_cpu_list_stays_on_the_host_and_the_rest_goes_in() {
        use std::os::unix::ffi::OsStringExt;
        let host = [
            ("PATH", "/bin"),
            ("VMCTL_SECCOMP", "off"),
            ("VMCTL_VCPU_CPUS", "2-3"),
        ];
        let lookup = |name: &str| {
            let found = host.iter().find(|(known, _)| *known == name);
            found.map(|(_, value)| value.to_string())
        };
        assert_eq!(vmm_env(lookup), [("VMCTL_SECCOMP".into(), "off".into())]);
        let not_utf8 = (OsString::from("LANG"), OsString::from_vec(vec![0xff]));
        let vars = host
            .map(|(name, value)| (OsString::from(name), OsString::from(value)))
            .into_iter()
            .chain([not_utf8]);
        let names: Vec<String> = command_env(vars)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(names, ["PATH", "VMCTL_SECCOMP"]);
    }

    #[test]
    fn the_virtio_console_reaches_the_nested_hosts_vmm_as_configured() {
        let mut config = VmConfig::new("/k".into());
        for with_console in [true, false] {
            config.virtio_console = with_console;
            let Work::Vm(vm) = NestedJob::for_vm(&config, None, false).work else {
                panic!("not a VM job")
            };
            assert_eq!(vm.vm_config().virtio_console, with_console);
        }
    }

    /// A VM's nested host gives back memory as the VM does; a command's never.
    #[test]
    fn the_nested_host_reports_free_pages_as_its_vm_does() {
        let mut config = VmConfig::new("/k".into());
        assert!(NestedJob::for_vm(&config, None, false).free_page_reporting());
        config.free_page_reporting = false;
        let job = NestedJob::for_vm(&config, None, false);
        assert!(!job.free_page_reporting());
        let Work::Vm(vm) = &job.work else {
            panic!("not a VM job: {job:?}")
        };
        assert!(!vm.vm_config().free_page_reporting);
        let command = CommandJob {
            argv: vec!["true".into()],
            cwd: "/".into(),
            env: Vec::new(),
        };
        assert!(!NestedJob::for_command(command, 1, 512, &[]).free_page_reporting());
    }

    #[test]
    fn job_round_trips_the_vm_config() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().to_path_buf();
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
        let shares = ShareSet {
            shares: vec![crate::shares::Share {
                host: dir.join("sub"),
                guest: "/work".into(),
                read_only: true,
            }],
            virtiofsd: "/usr/bin/virtiofsd".into(),
            failure_file: None,
            cache: Default::default(),
        };
        let job = NestedJob::for_vm(&config, Some(&shares), true);
        let text = serde_json::to_string(&job).unwrap();
        let back: NestedJob = serde_json::from_str(&text).unwrap();
        let Work::Vm(vm) = &back.work else {
            panic!("not a VM job: {back:?}")
        };
        assert_eq!(vm.vm_config(), config);
        assert_eq!(back.host_memory_mib, 512 + NESTED_HOST_OVERHEAD_MIB);
        let dir = dir.canonicalize().unwrap();
        assert_eq!(vm.shares.as_ref(), Some(&shares));
        let rw = |path: PathBuf| SharedDir {
            path,
            read_only: false,
        };
        assert_eq!(back.shared_dirs, vec![rw(dir.clone()), rw(dir.join("sub"))]);
        assert_eq!(
            back.fs_dirs,
            vec![FsDir {
                tag: "vmctl0".into(),
                path: dir.join("sub"),
                read_only: true
            }]
        );
    }
}
