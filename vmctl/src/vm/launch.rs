//! Launching a new VM: the files it boots, its guest agent's settings on the kernel
//! command line, the check that its shares fit the VMM, and the start of its
//! supervisor (`vmctl __supervise DIR`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::shares::{self, Share};
use crate::state::{VmDir, VmRecord};

use super::VmError;

/// Fills in `record`'s files to boot, building those not in the cache yet (`ensure`:
/// [`artifacts::ensure`], or a test's), the nested host's kernel too for a VM that
/// runs in it. All here, with their builds' progress on the terminal, before the
/// VM's boot is timed: a build in the supervisor (the nested host's kernel, minutes
/// after a compiler upgrade) would end the start with "did not answer in time".
///
/// The files are looked for at once (each lookup is a script working out its cache
/// key: some 0.1-0.3 s of a cold start when run one after another); `ensure` runs the
/// builds themselves one at a time.
pub(super) fn boot_files(
    record: &mut VmRecord,
    recipe: Option<&Path>,
    ensure: impl Fn(Artifact) -> Result<PathBuf, ArtifactError> + Sync,
) -> Result<(), VmError> {
    let ensure = &ensure;
    let (kernel, initrd, rootfs, nested_host_kernel) = std::thread::scope(|scope| {
        let nested_host_kernel = record
            .nested
            .then(|| scope.spawn(move || ensure(Artifact::NestedHostKernel)));
        let initrd = scope.spawn(move || ensure(Artifact::AgentInitramfs));
        let rootfs = scope.spawn(move || match recipe {
            Some(recipe) => artifacts::build_image(Some(recipe), artifacts::Unbuilt::EarlierMonth),
            None => ensure(Artifact::RootfsImage),
        });
        let kernel = ensure(Artifact::GuestKernel);
        let joined = |handle: std::thread::ScopedJoinHandle<'_, _>| {
            handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        };
        (
            kernel,
            joined(initrd),
            joined(rootfs),
            nested_host_kernel.map(joined),
        )
    });
    record.kernel = kernel?;
    record.initrd = initrd?;
    record.rootfs = rootfs?;
    record.nested_host_kernel = nested_host_kernel.transpose()?;
    Ok(())
}

/// The guest agent's settings: the root image, a tmpfs upper layer, the host user,
/// the shares to mount.
pub(super) fn agent_cmdline(vm: &VmDir, shares: &[Share], account: Option<&str>) -> String {
    let name = vm
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "vm".into());
    let mut cmdline = format!(
        "vmctl.root=/dev/vda vmctl.upper=tmpfs vmctl.hostname={}",
        guest_agent::init::hostname_from(&name)
    );
    if let Some(account) = account {
        cmdline.push_str(&format!(" vmctl.user={account}"));
    }
    for (index, share) in shares.iter().enumerate() {
        let mount = guest_agent::shares::ShareMount {
            tag: shares::tag(index),
            path: share.guest.clone(),
            read_only: share.read_only,
        };
        cmdline.push_str(&format!(
            " {}={}",
            guest_agent::shares::CMDLINE_KEY,
            mount.to_cmdline_value()
        ));
    }
    cmdline
}

/// The guest agent's parameter for when the guest drops its caches, from `resources`:
/// after the idle time they set (default
/// [`DEFAULT_DROP_CACHES_AFTER_IDLE_S`](crate::user_config::DEFAULT_DROP_CACHES_AFTER_IDLE_S)),
/// or never where its guest gives nothing back (no free page reporting): the memory
/// would stay the VM's anyway.
pub(super) fn drop_caches_param(resources: &crate::user_config::Resources) -> String {
    let after_s = match resources.reports_free_pages() {
        true => resources
            .drop_caches_after_idle_s
            .unwrap_or(crate::user_config::DEFAULT_DROP_CACHES_AFTER_IDLE_S),
        false => 0,
    };
    format!(" {}={after_s}", guest_agent::idle_caches::CMDLINE_KEY)
}

/// Refuses up front the shares the VM cannot have, which the VMM would refuse only
/// once the supervisor runs: more than its virtio device slots hold, or guest paths
/// the guest kernel's command line cannot.
pub(super) fn check_config_fits(vm: &VmDir, record: &VmRecord) -> Result<(), VmError> {
    let mut config = crate::supervisor::vm_config(vm, record);
    let share_count = record.shares.as_ref().map_or(0, |set| set.shares.len());
    // Each virtio-fs device adds its own parameter; the socket is not part of it.
    config.filesystems = (0..share_count)
        .map(|index| vmm::config::FsConfig {
            tag: shares::tag(index),
            socket_path: PathBuf::new(),
        })
        .collect();
    let devices = config.virtio_device_count();
    let max = vmm::arch::x86_64::layout::MAX_VIRTIO_DEVICES;
    if devices > max {
        return Err(VmError::TooManyShares {
            shares: share_count,
            devices,
            max,
            free_page_reporting: config.free_page_reporting,
        });
    }
    match config.check_cmdline() {
        Err(vmm::config::ConfigError::CmdlineTooLong { len, max }) => {
            Err(VmError::SharePathsTooLong { len, max })
        }
        _ => Ok(()),
    }
}

pub(super) fn spawn_supervisor(vm: &VmDir) -> Result<std::process::Child, VmError> {
    let exe = std::env::current_exe().map_err(VmError::Spawn)?;
    spawn_supervisor_from(&exe, vm)
}

/// Starts `exe __supervise DIR` (`exe`: vmctl's own executable, or a test's stand-in).
pub(super) fn spawn_supervisor_from(
    exe: &Path,
    vm: &VmDir,
) -> Result<std::process::Child, VmError> {
    use std::os::unix::process::CommandExt;
    // The last run's logs are kept beside the new ones: they say how it ended.
    for log in [vm.console_log(), vm.supervisor_log()] {
        if log.exists() {
            std::fs::rename(&log, crate::state::previous_run(&log)).map_err(VmError::Spawn)?;
        }
    }
    // Appending: the supervisor cuts them down when the guest makes them grow too large.
    let console = crate::log_keeper::create_appending(&vm.console_log()).map_err(VmError::Spawn)?;
    let log = crate::log_keeper::create_appending(&vm.supervisor_log()).map_err(VmError::Spawn)?;
    let mut command = Command::new(exe);
    command
        .arg("__supervise")
        .arg(&vm.path)
        .stdin(Stdio::null())
        .stdout(console)
        .stderr(log);
    // It runs as long as the VM: it must not keep what this vmctl's caller gave it.
    crate::vmm_process::start_without_inherited_descriptors(&mut command);
    // Its own session: the VM outlives this command and its terminal.
    // SAFETY: setsid is async-signal-safe and touches no memory.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut supervisor = command.spawn().map_err(VmError::Spawn)?;
    // Recorded now, while this vmctl holds the lifecycle lock, not only once the
    // supervisor is under way: were this vmctl to die first, a vmctl waiting for the
    // lock would find no VM running and start a second one in the same directory.
    // (Spawned means exec'd: its command line is already `vmctl __supervise DIR`, which
    // `running_pid` looks for.)
    if let Err(e) = vm.write_pid(supervisor.id()) {
        let _ = supervisor.kill();
        let _ = supervisor.wait();
        return Err(e.into());
    }
    Ok(supervisor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::*;

    /// The files a VM boots, as `boot_files` found them with `record.nested`, and
    /// which artifacts it asked for.
    fn boot_files_of(nested: bool) -> (VmRecord, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let mut record = crate::state::test_record(&vm, dir.path());
        record.nested = nested;
        record.nested_host_kernel = None;
        let asked = std::sync::Mutex::new(Vec::new());
        boot_files(&mut record, None, |artifact| {
            let name = format!("{artifact:?}");
            asked.lock().unwrap().push(name.clone());
            Ok(PathBuf::from("/cache").join(name))
        })
        .unwrap();
        (record, asked.into_inner().unwrap())
    }

    /// A VM that runs in the nested host has that host's kernel built with its own
    /// files, by `vmctl up` before the boot is timed, not by its supervisor.
    #[test]
    fn the_nested_host_kernel_is_built_before_the_boot_is_timed() {
        let (record, asked) = boot_files_of(true);
        assert_eq!(
            record.nested_host_kernel.as_deref(),
            Some(Path::new("/cache/NestedHostKernel"))
        );
        assert_eq!(record.kernel, Path::new("/cache/GuestKernel"));
        assert!(asked.contains(&"RootfsImage".to_string()), "{asked:?}");
        // A VM that runs on the host's KVM does without.
        let (record, asked) = boot_files_of(false);
        assert_eq!(record.nested_host_kernel, None);
        assert!(
            !asked.contains(&"NestedHostKernel".to_string()),
            "{asked:?}"
        );
    }

    /// A stand-in for vmctl's executable that ignores its arguments and sleeps.
    fn sleeper(dir: &Path) -> PathBuf {
        let path = dir.join("vmctl");
        crate::vmm_process::script(&path, "#!/bin/sh\nexec sleep 30\n");
        path
    }

    /// A caller waiting for the end of a pipe it gave vmctl (an IDE, an agent harness)
    /// is not kept waiting as long as the VM runs.
    #[test]
    fn the_supervisor_gets_no_descriptor_vmctl_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let exe = sleeper(dir.path());
        let held =
            crate::vmm_process::inherited_pipe_ends(|| spawn_supervisor_from(&exe, &vm).unwrap());
        assert!(
            held.is_empty(),
            "the supervisor holds the caller's pipe: {held:?}"
        );
    }

    /// The lifecycle lock's proof of a running VM is there before the supervisor writes
    /// it: a start that waits for the lock of one whose vmctl died just after starting
    /// the supervisor finds that VM running, and starts no second one.
    #[test]
    fn a_started_supervisor_is_recorded_before_it_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (vm, mut supervisor) = silent_supervisor(dir.path());
        let running = vm.running_pid();
        let _ = supervisor.kill();
        let _ = supervisor.wait();
        assert_eq!(running, Some(supervisor.id() as i32));
        let leftovers: Vec<_> = std::fs::read_dir(&vm.path)
            .unwrap()
            .flatten()
            .map(|entry| entry.file_name())
            .filter(|name| name.to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    /// What vmctl tells the guest, the guest takes: a value it refused would be a
    /// warning in the console log only (a workspace `my_project` had no host name).
    #[test]
    fn the_guest_takes_every_setting_of_the_command_line() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("my_project.v2-c61c616e"),
        };
        let shares = [Share {
            host: dir.path().into(),
            guest: dir.path().into(),
            read_only: true,
        }];
        let resources = crate::user_config::Resources {
            drop_caches_after_idle_s: Some(90),
            ..Default::default()
        };
        let cmdline = agent_cmdline(&vm, &shares, Some("alice:1000:1000:/home/alice"))
            + &drop_caches_param(&resources);
        let (config, refused) = guest_agent::init::parse_cmdline(&cmdline);
        assert!(refused.is_empty(), "{cmdline}: {refused:?}");
        assert_eq!(config.hostname.as_deref(), Some("my-project.v2-c61c616e"));
        assert_eq!(config.user.map(|user| user.name).as_deref(), Some("alice"));
        assert_eq!(
            config.drop_caches_idle,
            Some(std::time::Duration::from_secs(90))
        );
    }

    /// The caches go after the idle time the config sets, 300 s by default, and never
    /// where the guest gives no memory back.
    #[test]
    fn the_guest_drops_its_caches_only_where_it_gives_memory_back() {
        use crate::user_config::Resources;
        let idle = |resources: Resources| {
            let (config, refused) =
                guest_agent::init::parse_cmdline(&drop_caches_param(&resources));
            assert!(refused.is_empty(), "{refused:?}");
            config.drop_caches_idle.map(|after| after.as_secs())
        };
        assert_eq!(idle(Resources::default()), Some(300));
        let never = Resources {
            drop_caches_after_idle_s: Some(0),
            ..Default::default()
        };
        assert_eq!(idle(never), None);
        let keeps_memory = Resources {
            free_page_reporting: Some(false),
            drop_caches_after_idle_s: Some(60),
            ..Default::default()
        };
        assert_eq!(idle(keeps_memory), None);
    }

    #[test]
    fn shares_the_kernel_command_line_cannot_hold_are_refused_before_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let mut record = crate::state::test_record(&vm, dir.path());
        let share = |record: &mut VmRecord, guest: PathBuf| {
            let set = record.shares.as_mut().unwrap();
            set.shares.push(Share {
                host: dir.path().into(),
                guest,
                read_only: false,
            });
            record.agent_cmdline = agent_cmdline(&vm, &set.shares, None);
        };
        share(&mut record, PathBuf::from("/data/").join("d".repeat(200)));
        check_config_fits(&vm, &record).unwrap();
        share(&mut record, PathBuf::from("/data/").join("x".repeat(1800)));
        let error = check_config_fits(&vm, &record).unwrap_err().to_string();
        assert!(error.contains("at most 2047"), "{error}");
        assert!(error.contains("--mount HOST:GUEST"), "{error}");
    }

    /// More shares than the VM's virtio slots hold are refused before the start, with
    /// how many to drop; the balloon's slot is named as one to give up while it has it.
    #[test]
    fn shares_past_the_virtio_slots_are_refused_before_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let mut record = crate::state::test_record(&vm, dir.path());
        let set = record.shares.as_mut().unwrap();
        set.shares.clear();
        // The root disk, rng, vsock, the balloon and the console take 5 of the 19 slots.
        for index in 0..14 {
            set.shares.push(Share {
                host: dir.path().into(),
                guest: PathBuf::from(format!("/s{index}")),
                read_only: false,
            });
        }
        record.agent_cmdline = agent_cmdline(&vm, &set.shares, None);
        record.free_page_reporting = true;
        check_config_fits(&vm, &record).unwrap();

        let set = record.shares.as_mut().unwrap();
        set.shares.push(Share {
            host: dir.path().into(),
            guest: PathBuf::from("/s14"),
            read_only: false,
        });
        record.agent_cmdline = agent_cmdline(&vm, &set.shares, None);
        let error = check_config_fits(&vm, &record).unwrap_err().to_string();
        assert!(error.contains("15 shares"), "{error}");
        assert!(error.contains("need 20 virtio devices"), "{error}");
        assert!(error.contains("share 1 fewer"), "{error}");
        assert!(error.contains("free_page_reporting = false"), "{error}");

        // Without the balloon the same 15 shares fit.
        record.free_page_reporting = false;
        check_config_fits(&vm, &record).unwrap();
    }
}
