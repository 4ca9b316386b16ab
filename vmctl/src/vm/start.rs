//! Starting a workspace's VM: `vmctl up`, and what `exec`/`shell`/`run` do to find
//! or start their VM. The shares, the VM's size, its kernel command line, the
//! supervisor's start, and the wait for the guest agent.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmm::process::cpus::CpuSet;

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::cli::VmSetupArgs;
use crate::exec::AGENT_PORT;
use crate::host_kvm::KvmKind;
use crate::network::control::{self, ControlError, ControlRequest, ControlResponse};
use crate::shares::{self, Share, ShareSet};
use crate::state::{EgressTestOptions, StateError, VmDir, VmRecord};
use crate::user_config::{Resources, UserConfig};
use crate::virtiofsd;

use super::lock::{lock_lifecycle, try_lock_lifecycle};
use super::stop::{remove_dir, remove_vm};
use super::{agent_runtime, VmError};

/// Defaults for a workspace VM: this share of the host's RAM, at least this much.
pub const DEFAULT_MEMORY_PERCENT: u32 = 10;
pub const DEFAULT_MEMORY_MIN_MIB: u64 = 1024;
/// How long a VM may take until its guest agent answers.
const BOOT_TIMEOUT_DIRECT: Duration = Duration::from_secs(30);
const BOOT_TIMEOUT_NESTED: Duration = Duration::from_secs(240);
/// How long a start waits, silent, for the agent of a VM already running.
const AGENT_WAIT_NOTICE: Duration = Duration::from_secs(2);
/// How often a booting VM's agent is asked whether it is ready: the interval is
/// added to every cold start, so short where boots take milliseconds.
const READY_POLL_DIRECT: Duration = Duration::from_millis(10);
const READY_POLL_NESTED: Duration = Duration::from_millis(100);
/// Logged (at info) when a VM's agent first answers; the benchmark times its arrival
/// (`benches/src/cold_start.rs` has the same text).
const AGENT_READY_LOG: &str = "guest agent ready";

/// How to start a workspace's VM when it is not running.
#[derive(Debug, Default)]
pub struct StartOptions<'a> {
    /// Boot the image of this recipe instead of the default one.
    pub recipe: Option<&'a Path>,
    /// Extra shares, `HOST[:GUEST][:ro]` (relative HOSTs are relative to the current
    /// directory), besides those of the user's config file.
    pub mounts: &'a [String],
    /// Host loopback ports to relay into the guest (besides Paseo's and the config's).
    pub relay_ports: &'a [u16],
    /// Test-only egress settings (`vmctl up --egress-test-*`), for a new VM.
    pub egress: Option<&'a EgressTestOptions>,
    /// No "already running" / "is up" messages.
    pub quiet: bool,
}

/// Starts the VM of `workspace` unless it runs; returns its directory once the guest
/// agent answers.
pub fn up(workspace: &Path, options: &StartOptions) -> Result<VmDir, VmError> {
    check_workspace_ways(workspace)?;
    let (workspace, vm) = VmDir::for_workspace(workspace)?;
    start(&workspace, vm.clone(), options).inspect_err(|_| forget_if_never_started(&vm))
}

/// Removes the directory of `vm` when a refused start (a workspace in $HOME, a bad
/// `--mount`) leaves it as it was made, without a record: `vmctl ps` does not list
/// such a directory, and only `vmctl prune` would remove it. One with a record (a VM
/// that ran, or whose boot failed, with the logs the error names) is kept, and so is
/// one another `vmctl` is starting (it holds the lifecycle lock).
fn forget_if_never_started(vm: &VmDir) {
    let Ok(Some(_lifecycle_lock)) = try_lock_lifecycle(vm) else {
        return;
    };
    if vm.record_path().exists() || vm.running_pid().is_some() {
        return;
    }
    if let Err(e) = remove_dir(vm) {
        tracing::debug!("cannot remove {}: {e}", vm.path.display());
    }
}

/// Starts `vm`, a throwaway VM for `workspace` ([`VmDir::throwaway`]) beside its
/// regular one (`vmctl run`).
pub fn up_throwaway(workspace: &Path, vm: VmDir, setup: &VmSetupArgs) -> Result<VmDir, VmError> {
    let options = StartOptions {
        mounts: &setup.mounts,
        relay_ports: &setup.relay_ports,
        quiet: true,
        ..StartOptions::default()
    };
    start(workspace, vm.clone(), &options).inspect_err(|_| {
        // Refused before it booted: nothing in it is worth keeping. (One whose boot
        // failed keeps the logs the error names; `vmctl prune` forgets it.)
        if vm.read_record().is_err() {
            let _ = remove_vm(&vm, "its start was refused");
        }
    })
}

/// Refuses `workspace` (as named, or found from the current directory) if the user
/// reached it through a link a guest made ([`shares::check_workspace_way`]): as named
/// (relative to where the shell stands), and from the current directory as the shell
/// reached it, when that lies in the workspace.
pub fn check_workspace_ways(workspace: &Path) -> Result<(), VmError> {
    let cwd = crate::workspace::logical_current_dir();
    let mut ways = vec![cwd.join(workspace)];
    let canonical = |path: &Path| path.canonicalize().ok();
    if let (Some(here), Some(root)) = (canonical(&cwd), canonical(workspace)) {
        if here.starts_with(&root) {
            ways.push(cwd);
        }
    }
    let shares: Vec<Share> = vms_shares(None).collect();
    for way in ways {
        shares::check_workspace_way(&way, &shares)?;
    }
    Ok(())
}

/// What a start asks for, checked whether or not the VM already runs: a typo in a
/// `--mount`, a recipe that is not there or a broken config file is an error either
/// way, not only at the next start (often a Paseo agent's, after the idle stop, far
/// from the edit).
struct Request {
    config: UserConfig,
    /// The config file's mounts for the workspace, then the command's.
    mounts: Vec<shares::WrittenMount>,
    /// `vmctl.user` of a new VM's agent ([`crate::guest_account`]).
    guest_account: Option<String>,
    /// Why a new VM's commands would run as root, said only when one boots.
    account_warning: Option<String>,
}

fn check_request(
    workspace: &Path,
    mounts: &[String],
    recipe: Option<&Path>,
) -> Result<Request, VmError> {
    let config = UserConfig::load()?;
    let cwd = std::env::current_dir().unwrap_or_else(|_| workspace.to_path_buf());
    let mut written = Vec::new();
    for spec in config.mounts_for(workspace) {
        let mount = shares::parse_mount_as_written(&spec, workspace).map_err(|source| {
            VmError::ConfigMount {
                config: crate::user_config::config_path().unwrap_or_default(),
                source,
            }
        })?;
        written.push(mount);
    }
    for spec in mounts {
        written.push(shares::parse_mount_as_written(spec, &cwd)?);
    }
    if let Some(recipe) = recipe {
        check_recipe(recipe)?;
    }
    let mut account_warning = None;
    let guest_account =
        crate::guest_account::guest_account(|warning| account_warning = Some(warning))?;
    Ok(Request {
        config,
        mounts: written,
        guest_account,
        account_warning,
    })
}

/// Refuses a recipe that is not a readable file (the build script would say so only
/// when it runs, i.e. never while the VM runs).
fn check_recipe(recipe: &Path) -> Result<(), VmError> {
    let error = |source| VmError::Recipe {
        path: recipe.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(recipe).map_err(error)?;
    match file.metadata() {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(_) => Err(error(std::io::Error::other("not a file"))),
        Err(e) => Err(error(e)),
    }
}

/// Whether `requested` (a start's mounts) asks for a share the running VM, started
/// with `record`, does not have: only then is "it keeps its shares" worth saying.
fn asks_for_new_shares(requested: &[shares::WrittenMount], record: Option<&VmRecord>) -> bool {
    let running: &[Share] = record
        .and_then(|record| record.shares.as_ref())
        .map_or(&[], |set| set.shares.as_slice());
    requested
        .iter()
        .any(|mount| !running.contains(&mount.share))
}

/// The workspace, then the config file's shares, then `mounts` (both from the
/// checked `request`), then a worktree workspace's repository, in mount order.
fn resolve_shares(workspace: &Path, vm: &VmDir, request: &Request) -> Result<ShareSet, VmError> {
    let agent_home = crate::agent::agent_home_dir(vm);
    std::fs::create_dir_all(&agent_home).map_err(|source| StateError::Io {
        path: agent_home.clone(),
        source,
    })?;
    let agent_home = Share {
        host: agent_home.canonicalize().unwrap_or(agent_home),
        guest: crate::agent::AGENT_HOMES_IN_GUEST.into(),
        read_only: false,
    };
    let mut list = vec![shares::workspace_share(workspace)?, agent_home.clone()];
    let written = &request.mounts;
    list.extend(written.iter().map(|mount| mount.share.clone()));
    // Every VM's guest, running or not, may have left links in its writable shares.
    let guarded: Vec<Share> = list.iter().cloned().chain(other_vms_shares(vm)).collect();
    shares::check_no_guest_symlinks(written, &guarded)?;
    match crate::worktree::repository_share(workspace, &list) {
        Ok(Some(repository)) => list.push(repository),
        Ok(None) => {}
        // `why` quotes the worktree's .git file, which the guest writes.
        Err(why) => vmm::to_stderr!(
            "vmctl: warning: {} is a git worktree, but {}; git in the VM will not find \
             its repository",
            workspace.display(),
            crate::terminal::one_line(&why)
        ),
    }
    shares::check_shares(&list)?;
    shares::check_mount_points(&list)?;
    // The agents' home is vmctl's own, in its state directory, for the guest to have.
    let kept_out = shares::kept_out_of_the_guest();
    for share in list.iter().filter(|share| **share != agent_home) {
        shares::check_kept_out(share, &kept_out)?;
        shares::check_not_pseudo_filesystem(share)?;
    }
    // The shares the user added only: the workspace may well hold a directory on PATH.
    let program_dirs = shares::host_program_dirs();
    for mount in written {
        shares::check_not_program_dir(mount, &program_dirs)?;
    }
    Ok(ShareSet {
        shares: shares::mount_order(list),
        virtiofsd: virtiofsd::find_virtiofsd()?,
        failure_file: Some(vm.share_failures()),
        cache: virtiofsd::CachePolicy::from_env()?,
    })
}

/// The shares every other VM was last started with, running or not: what their
/// guests may have written.
fn other_vms_shares(vm: &VmDir) -> impl Iterator<Item = Share> + '_ {
    vms_shares(Some(vm))
}

/// The shares every VM (but `except`) was last started with, running or not.
fn vms_shares(except: Option<&VmDir>) -> impl Iterator<Item = Share> + '_ {
    VmDir::all()
        .into_iter()
        .filter(move |other| except.is_none_or(|vm| other.path != vm.path))
        .filter_map(|other| other.read_record().ok()?.shares)
        .flat_map(|set| set.shares)
}

/// Says when what vmctl builds and runs on the host at a start (the guest agent from
/// vmctl's sources, each start: cargo and build scripts; an image from a recipe, whose
/// script runs as root in a chroot) lies where a VM can write, this one or another:
/// a guest could have put there what then runs on the host.
fn warn_of_builds_from_guest_writable(vm: &VmDir, record: &VmRecord, recipe: Option<&Path>) {
    let own = record
        .shares
        .iter()
        .flat_map(|set| set.shares.iter().cloned());
    let writable: Vec<PathBuf> = own
        .chain(other_vms_shares(vm))
        .filter(|share| !share.read_only)
        .map(|share| share.host)
        .collect();
    let recipe = recipe.and_then(|recipe| recipe.canonicalize().ok());
    for (what, path, share) in builds_within(&artifacts::source_dir(), recipe, &writable) {
        vmm::to_stderr!(
            "vmctl: warning: a VM can write {}, which holds {what} ({}): what vmctl builds \
             from there on this host runs with whatever a guest put there",
            share.display(),
            path.display()
        );
    }
}

/// Which of `sources` and `recipe` lie in one of `writable`, with that directory.
fn builds_within<'a>(
    sources: &Path,
    recipe: Option<PathBuf>,
    writable: &'a [PathBuf],
) -> Vec<(&'static str, PathBuf, &'a PathBuf)> {
    [
        ("vmctl's sources", Some(sources.to_path_buf())),
        ("the recipe", recipe),
    ]
    .into_iter()
    .filter_map(|(what, path)| {
        let path = path?;
        let share = writable.iter().find(|share| path.starts_with(share))?;
        Some((what, path, share))
    })
    .collect()
}

/// Tells the user about shares the running VM lost.
fn warn_about_share_failures(vm: &VmDir) {
    for failure in vm.read_share_failures() {
        vmm::to_stderr!("vmctl: warning: {failure}");
    }
}

fn start(workspace: &Path, vm: VmDir, options: &StartOptions) -> Result<VmDir, VmError> {
    let StartOptions {
        recipe,
        mounts,
        relay_ports,
        egress,
        quiet,
    } = *options;
    let workspace = workspace.to_path_buf();
    let request = check_request(&workspace, mounts, recipe)?;
    crate::network::guest_setup::warn_of_unusable_egress_files();
    // Two sessions starting the same workspace at once must not boot two VMs: the
    // second waits here, then finds the first's VM running. So does a session that
    // comes as the daemon stops the VM for idleness: it then boots a fresh one.
    let _lifecycle_lock = lock_lifecycle(&vm, || {
        vmm::to_stderr!(
            "vmctl: another vmctl is starting or stopping the VM of {}; waiting for it",
            workspace.display()
        )
    })?;
    if vm
        .running_pid()
        .is_some_and(|pid| !agent_answered_for(&vm, pid))
    {
        // Running: it may still be booting (another vmctl started it). Never start a
        // second VM over it.
        wait_for_running_agent(&vm, &workspace)?;
    }
    if vm.running_pid().is_some() {
        if !quiet {
            vmm::to_stderr!(
                "vmctl: the VM of {} is already running",
                workspace.display()
            );
        }
        if recipe.is_some() {
            vmm::to_stderr!(
                "vmctl: warning: it keeps the image it was started with; \
                 'vmctl stop' it first to boot another"
            );
        }
        if asks_for_new_shares(&request.mounts, vm.read_record().ok().as_ref()) {
            vmm::to_stderr!(
                "vmctl: warning: it keeps the shares it was started with; \
                 'vmctl stop' it first to change them"
            );
        }
        if egress.is_some() {
            vmm::to_stderr!("vmctl: warning: it keeps the egress settings it was started with");
        }
        warn_about_share_failures(&vm);
        configure_network(&vm, relay_ports)?;
        return Ok(vm);
    }
    if let Some(crash) = vm.read_crash() {
        // Whatever ran in it, and its root's changes, are gone: say so.
        vmm::to_stderr!(
            "vmctl: the last VM of {} crashed ({crash}); starting a new one (the crashed \
             run's logs: `vmctl logs --previous [--supervisor]`)",
            workspace.display(),
        );
    }
    let share_set = resolve_shares(&workspace, &vm, &request)?;
    if let Some(warning) = &request.account_warning {
        vmm::to_stderr!("vmctl: warning: {warning}");
    }
    let kvm = KvmKind::detect();
    let nested = !kvm.boots_linux();
    if nested {
        kvm.announce_nested();
    }
    let resources = request.config.resources_for(&workspace);
    let (cpus, memory_mib) = vm_size(resources);
    let mut record = VmRecord {
        // Filled in last: a start refused for its shares must not first build them.
        kernel: PathBuf::new(),
        initrd: PathBuf::new(),
        rootfs: PathBuf::new(),
        nested_host_kernel: None,
        cpus,
        memory_mib,
        free_page_reporting: resources.free_page_reporting.unwrap_or(true),
        nested,
        agent_cmdline: agent_cmdline(&vm, &share_set.shares, request.guest_account.as_deref()),
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        workspace: workspace.clone(),
        shares: Some(share_set),
        relay_ports: relays_for(&request.config, &workspace, relay_ports),
        egress: egress.cloned().unwrap_or_default(),
        vsock_socket: Some(vm.vsock_socket()),
    };
    check_config_fits(&vm, &record)?;
    warn_of_builds_from_guest_writable(&vm, &record, recipe);
    // The user waits for the VM from here: "agent ready after" counts the lookups of
    // its files too (builds, when there are some, show their own progress).
    let looked_up = Instant::now();
    boot_files(&mut record, recipe, artifacts::ensure)?;
    vm.write_record(&record)?;
    let started = Instant::now();
    let supervisor = spawn_supervisor(&vm)?;
    wait_for_new_agent(&vm, &workspace, supervisor, nested, started)?;
    // The supervisor's stderr is its log: what it warned of while the VM started (a
    // virtiofsd without its sandbox, shares too large to watch) is said here too.
    let log = std::fs::read_to_string(vm.supervisor_log()).unwrap_or_default();
    for warning in warnings_in(&log) {
        vmm::to_stderr!("{warning}");
    }
    let ready_after = looked_up.elapsed();
    tracing::info!(
        "{AGENT_READY_LOG} after {} ms (VM of {})",
        ready_after.as_millis(),
        workspace.display()
    );
    configure_network(&vm, &[])?;
    if !quiet {
        vmm::to_stderr!(
            "vmctl: the VM of {} is up (agent ready after {:.1} s)",
            workspace.display(),
            ready_after.as_secs_f64()
        );
    }
    Ok(vm)
}

/// How long a VM may take until its guest agent answers.
fn boot_timeout(nested: bool) -> Duration {
    if nested {
        BOOT_TIMEOUT_NESTED
    } else {
        BOOT_TIMEOUT_DIRECT
    }
}

/// Waits for the agent of `vm`, which runs but has not yet answered a start (another
/// vmctl started it, and it may still be booting): until it answers or the VM stops,
/// within [`boot_timeout`].
fn wait_for_running_agent(vm: &VmDir, workspace: &Path) -> Result<(), VmError> {
    let nested = vm.read_record().map_or(true, |record| record.nested);
    let boot_timeout = boot_timeout(nested);
    let waiting_since = Instant::now();
    let deadline = waiting_since + boot_timeout;
    let mut said = false;
    loop {
        match agent_state(&vm.vsock_socket()) {
            AgentState::Answers => {
                mark_agent_answered(vm);
                return Ok(());
            }
            AgentState::OtherProtocol(agent_said) => {
                return Err(VmError::OtherAgent {
                    workspace: workspace.to_path_buf(),
                    agent_said,
                })
            }
            AgentState::Silent => {}
        }
        if vm.running_pid().is_none() {
            return Ok(());
        }
        if vm.runs_an_older_layout() {
            return Err(VmError::NotReady {
                workspace: workspace.to_path_buf(),
                reason: "it was started by an older vmctl, which kept its vsock socket \
                         elsewhere ('vmctl stop' it, then start it again)"
                    .into(),
                vm_dir: vm.path.clone(),
            });
        }
        if Instant::now() > deadline {
            return Err(VmError::NotReady {
                workspace: workspace.to_path_buf(),
                reason: format!(
                    "it is running, but its guest agent did not answer within {} s \
                     ('vmctl stop' it, then start it again)",
                    boot_timeout.as_secs()
                ),
                vm_dir: vm.path.clone(),
            });
        }
        if !said && waiting_since.elapsed() >= AGENT_WAIT_NOTICE {
            vmm::to_stderr!(
                "vmctl: the VM of {} runs, but its guest agent does not answer yet \
                 (still booting?); waiting up to {} s",
                workspace.display(),
                boot_timeout.as_secs()
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the agent of `vm`, whose `supervisor` was started at `started`,
/// answers, within [`boot_timeout`]; on a terminal, a line counts the seconds
/// meanwhile. A supervisor that exits fails the start; one whose agent does not
/// answer in time, or speaks another protocol, is killed.
fn wait_for_new_agent(
    vm: &VmDir,
    workspace: &Path,
    mut supervisor: std::process::Child,
    nested: bool,
    started: Instant,
) -> Result<(), VmError> {
    let mut notice = crate::start_notice::StartNotice::on_terminal();
    let boot_timeout = boot_timeout(nested);
    let deadline = started + boot_timeout;
    loop {
        let not_ready = |reason: String| VmError::NotReady {
            workspace: workspace.to_path_buf(),
            reason,
            vm_dir: vm.path.clone(),
        };
        match agent_state(&vm.vsock_socket()) {
            AgentState::Answers => {
                mark_agent_answered(vm);
                break;
            }
            AgentState::OtherProtocol(agent_said) => {
                let _ = supervisor.kill();
                return Err(not_ready(fresh_agent_mismatch(&agent_said)));
            }
            AgentState::Silent => {}
        }
        if let Ok(Some(status)) = supervisor.try_wait() {
            return Err(not_ready(format!(
                "its supervisor exited ({status}){}",
                log_tail(&vm.supervisor_log())
            )));
        }
        if Instant::now() > deadline {
            let _ = supervisor.kill();
            return Err(not_ready(format!(
                "the guest agent did not answer within {} s",
                boot_timeout.as_secs()
            )));
        }
        notice.update(workspace, started.elapsed());
        std::thread::sleep(if nested {
            READY_POLL_NESTED
        } else {
            READY_POLL_DIRECT
        });
    }
    notice.clear();
    Ok(())
}

/// The file in a VM's directory naming the supervisor (pid and start time) whose guest
/// agent answered a start: a session that finds it still running knows the VM booted,
/// without a round trip to the agent of its own (which every `vmctl exec` paid).
const AGENT_ANSWERED: &str = "agent-answered";

fn supervisor_named(pid: i32) -> Option<String> {
    Some(format!("{pid} {}", crate::procfs::start_time(pid)?))
}

/// Records that the agent of `vm`'s running supervisor answered. Best effort: without
/// the file, the next session asks the agent itself.
fn mark_agent_answered(vm: &VmDir) {
    if let Some(named) = vm.running_pid().and_then(supervisor_named) {
        let _ = std::fs::write(vm.path.join(AGENT_ANSWERED), named);
    }
}

/// Whether the agent of supervisor `pid` answered a start already.
fn agent_answered_for(vm: &VmDir, pid: i32) -> bool {
    let recorded = std::fs::read_to_string(vm.path.join(AGENT_ANSWERED));
    recorded.is_ok_and(|recorded| Some(recorded) == supervisor_named(pid))
}

/// Fills in `record`'s files to boot, building those not in the cache yet (`ensure`:
/// [`artifacts::ensure`], or a test's), the nested host's kernel too for a VM that
/// runs in it. All here, with their builds' progress on the terminal, before the
/// VM's boot is timed: a build in the supervisor (the nested host's kernel, minutes
/// after a compiler upgrade) would end the start with "did not answer in time".
///
/// The files are looked for at once (each lookup is a script working out its cache
/// key: some 0.1-0.3 s of a cold start when run one after another); `ensure` runs the
/// builds themselves one at a time.
fn boot_files(
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
            Some(recipe) => artifacts::build_image(Some(recipe)),
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

/// vCPUs and MiB of a new VM: the config's, else one vCPU per CPU the VM may run on
/// and 10% of the host's RAM (at least 1 GiB).
fn vm_size(resources: Resources) -> (u32, u64) {
    let host_cpus = vm_cpu_count();
    let host_mib = vmm::config::host_memory_mib().unwrap_or(0);
    if let Some(asked) = resources.cpus.filter(|&asked| asked > host_cpus) {
        tracing::warn!("the vmctl config asks for {asked} vCPUs, but VMs may run on {host_cpus} CPUs here; the VM gets {}", host_cpus.min(MAX_VCPUS));
    } else if let Some(asked) = resources.cpus.filter(|&asked| asked > MAX_VCPUS) {
        tracing::warn!("the vmctl config asks for {asked} vCPUs, but the VMM gives a VM at most {MAX_VCPUS}; the VM gets {MAX_VCPUS}");
    }
    let minimum = resources.memory_min_mib.unwrap_or(DEFAULT_MEMORY_MIN_MIB);
    if host_mib > 0 && minimum > host_mib {
        tracing::warn!(
            "a VM of at least {minimum} MiB (memory_min_mib) does not fit this host's \
             {host_mib} MiB of RAM; the VM gets {host_mib} MiB (lower memory_min_mib in the \
             vmctl config)"
        );
    }
    size_from(resources, host_cpus, host_mib)
}

/// The most vCPUs the VMM gives a VM (all its MP table describes): a host with more
/// CPUs still gets VMs, of this many.
const MAX_VCPUS: u32 = vmm::config::MAX_VCPUS;

/// How many CPUs a VM may run on: those `VMCTL_VCPU_CPUS` names (the VMM's vCPUs, or
/// the nested host, run there only), else those this process may use. A list the VMM
/// would refuse counts as unset here: the VMM says what is wrong with it.
fn vm_cpu_count() -> u32 {
    match CpuSet::from_env() {
        // At most CPU_SETSIZE (1024) CPUs.
        Ok(Some(set)) => set.cpus().len() as u32,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    }
}

fn size_from(resources: Resources, host_cpus: u32, host_mib: u64) -> (u32, u64) {
    let cpus = resources
        .cpus
        .unwrap_or(host_cpus)
        .clamp(1, host_cpus.clamp(1, MAX_VCPUS));
    let percent = u64::from(
        resources
            .memory_percent
            .unwrap_or(DEFAULT_MEMORY_PERCENT)
            .min(100),
    );
    let minimum = resources.memory_min_mib.unwrap_or(DEFAULT_MEMORY_MIN_MIB);
    let memory_mib = (host_mib * percent / 100).max(minimum);
    // More than the host has, the VMM refuses (0: the host's size is unknown).
    let fits = if host_mib > 0 { host_mib } else { memory_mib };
    (cpus, memory_mib.min(fits))
}

/// Paseo's port (unless the config says not to), the config's relay ports for
/// `workspace`, then `extra`, without repeats.
fn relays_for(config: &UserConfig, workspace: &Path, extra: &[u16]) -> Vec<u16> {
    let mut ports = Vec::new();
    if config.relays_paseo(workspace) {
        ports.push(crate::network::PASEO_PORT);
    }
    ports.extend(config.relay_ports_for(workspace));
    ports.extend(extra);
    let mut seen = std::collections::BTreeSet::new();
    ports.retain(|port| seen.insert(*port));
    ports
}

/// Has the supervisor (re)configure the guest's network: the CA, the proxy
/// variables, current placeholder credentials, and `extra_relays`.
fn configure_network(vm: &VmDir, extra_relays: &[u16]) -> Result<(), VmError> {
    let request = ControlRequest::Configure {
        relay_ports: extra_relays.to_vec(),
    };
    match control::request(&vm.control_socket(), &request)? {
        ControlResponse::Configured { failed_relays, .. } => {
            for (port, reason) in failed_relays {
                vmm::to_stderr!("vmctl: warning: port {port} is not relayed into the VM: {reason}");
            }
            Ok(())
        }
        other => Err(VmError::Network(ControlError::Refused(format!(
            "unexpected answer to the network setup: {other:?}"
        )))),
    }
}

/// The warnings vmctl and its VMM wrote in a supervisor's log (the VMM's: running
/// without its jail or Landlock, which the user must hear of at the start too).
fn warnings_in(log: &str) -> impl Iterator<Item = &str> {
    let vmm_warning = format!("{}: warning: ", vmm::process::BINARY);
    log.lines().filter(move |line| {
        line.starts_with("vmctl: warning: ") || line.starts_with(vmm_warning.as_str())
    })
}

/// The last lines of a log, to quote in an error (empty when there are none).
fn log_tail(path: &Path) -> String {
    // Its end only, and a byte that is not UTF-8 (a guest's words quoted) does not
    // cost the rest.
    let tail = crate::log_keeper::read_tail(path, 64 << 10).unwrap_or_default();
    let text = String::from_utf8_lossy(&tail);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(5)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!(":\n  {}\n", tail.join("\n  "))
    }
}

/// The guest agent's settings: the root image, a tmpfs upper layer, the host user,
/// the shares to mount.
fn agent_cmdline(vm: &VmDir, shares: &[Share], account: Option<&str>) -> String {
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

/// Refuses up front the shares the VM cannot have, which the VMM would refuse only
/// once the supervisor runs: more than its virtio device slots hold, or guest paths
/// the guest kernel's command line cannot.
fn check_config_fits(vm: &VmDir, record: &VmRecord) -> Result<(), VmError> {
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

fn spawn_supervisor(vm: &VmDir) -> Result<std::process::Child, VmError> {
    let exe = std::env::current_exe().map_err(VmError::Spawn)?;
    spawn_supervisor_from(&exe, vm)
}

/// Starts `exe __supervise DIR` (`exe`: vmctl's own executable, or a test's stand-in).
fn spawn_supervisor_from(exe: &Path, vm: &VmDir) -> Result<std::process::Child, VmError> {
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

/// Why the guest agent of a VM this vmctl just booted speaks another protocol, and
/// what to do. Its image was built from the sources in [`artifacts::source_dir`], so a
/// newer agent means vmctl itself is older than those sources: a `git pull` without
/// `scripts/setup.sh` rebuilds the agent at the next start, but not vmctl.
fn fresh_agent_mismatch(agent_said: &str) -> String {
    let ours = guest_agent::protocol::PROTOCOL_VERSION;
    let vmctl = std::env::current_exe()
        .map_or_else(|_| "vmctl".to_owned(), |exe| exe.display().to_string());
    match guest_agent::protocol::version_spoken_in(agent_said) {
        Some(theirs) if theirs > ours => format!(
            "its guest agent, built from the sources in {}, speaks protocol {theirs}, and \
             this vmctl ({vmctl}) speaks {ours}: vmctl is older than its sources (pulled \
             but not rebuilt?); rebuild it with scripts/setup.sh",
            artifacts::source_dir().display()
        ),
        Some(theirs) => format!(
            "its guest agent speaks protocol {theirs}, older than this vmctl's {ours}: the \
             agent image is stale (an old VMCTL_AGENT_INITRAMFS?); rebuild it with \
             scripts/setup.sh"
        ),
        None => format!(
            "its guest agent speaks another protocol version ({agent_said}); rebuild it \
             with scripts/setup.sh"
        ),
    }
}

/// Whether a VM's guest agent answers a health check, as [`agent_state`] found it.
#[derive(Debug, PartialEq, Eq)]
enum AgentState {
    Answers,
    /// No answer (yet): the VM is booting, or stuck.
    Silent,
    /// It answers in another protocol version: it is not the agent of this vmctl,
    /// and waiting will not change that. The agent's words.
    OtherProtocol(String),
}

fn agent_state(socket: &Path) -> AgentState {
    if !socket.exists() {
        return AgentState::Silent;
    }
    let Some(runtime) = agent_runtime() else {
        return AgentState::Silent;
    };
    runtime.block_on(async {
        let check = async {
            let connection = guest_agent::client::connect_hybrid(socket, AGENT_PORT).await?;
            connection.health().await
        };
        match tokio::time::timeout(Duration::from_secs(5), check).await {
            Ok(Ok(_)) => AgentState::Answers,
            Ok(Err(guest_agent::client::ClientError::OtherProtocol(message))) => {
                AgentState::OtherProtocol(message)
            }
            _ => AgentState::Silent,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::*;

    /// Paseo's port first unless the config turns it off; then the config's ports and
    /// the extra ones, each once.
    #[test]
    fn the_relays_are_paseos_unless_turned_off_then_the_configs_and_the_extra_ones() {
        let workspace = tempfile::tempdir().unwrap();
        let config = |text: &str| -> UserConfig { toml::from_str(text).unwrap() };
        let paseo = crate::network::PASEO_PORT;
        assert_eq!(
            relays_for(
                &config("relay_ports = [5432]"),
                workspace.path(),
                &[8080, 5432]
            ),
            [paseo, 5432, 8080]
        );
        assert_eq!(
            relays_for(
                &config("relay_paseo = false\nrelay_ports = [5432]"),
                workspace.path(),
                &[paseo]
            ),
            [5432, paseo],
            "asked for by a session, it is relayed all the same"
        );
        assert_eq!(
            relays_for(&config("relay_paseo = false"), workspace.path(), &[]),
            [] as [u16; 0]
        );
    }

    #[test]
    fn a_recipe_that_is_not_there_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nonexistent.recipe");
        let message = check_recipe(&missing).unwrap_err().to_string();
        assert!(message.contains("nonexistent.recipe"), "{message}");
        assert!(
            check_recipe(dir.path()).is_err(),
            "a directory is no recipe"
        );
        let recipe = dir.path().join("mine.recipe");
        std::fs::write(&recipe, "{}").unwrap();
        check_recipe(&recipe).unwrap();
    }

    #[test]
    fn only_shares_the_running_vm_lacks_are_worth_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let mut record = crate::state::test_record(&vm, dir.path());
        let mount = |spec: &str| shares::parse_mount_as_written(spec, dir.path()).unwrap();
        record
            .shares
            .as_mut()
            .unwrap()
            .shares
            .push(mount("data:/data:ro").share);
        assert!(!asks_for_new_shares(&[], Some(&record)));
        assert!(!asks_for_new_shares(
            &[mount("data:/data:ro")],
            Some(&record)
        ));
        assert!(asks_for_new_shares(&[mount("data:/data")], Some(&record)));
        assert!(asks_for_new_shares(
            &[mount("data:/other:ro")],
            Some(&record)
        ));
        assert!(asks_for_new_shares(&[mount("data:/data:ro")], None));
    }

    #[test]
    fn a_refused_start_leaves_no_directory_but_a_started_vm_keeps_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let refused = VmDir {
            path: dir.path().join("refused"),
        };
        std::fs::create_dir_all(refused.path.join("agent-home")).unwrap();
        forget_if_never_started(&refused);
        assert!(!refused.path.exists());

        let started = VmDir {
            path: dir.path().join("started"),
        };
        std::fs::create_dir(&started.path).unwrap();
        started
            .write_record(&crate::state::test_record(&started, dir.path()))
            .unwrap();
        forget_if_never_started(&started);
        assert!(started.record_path().exists());

        let starting = VmDir {
            path: dir.path().join("starting"),
        };
        std::fs::create_dir(&starting.path).unwrap();
        let _held = try_lock_lifecycle(&starting).unwrap().unwrap();
        let other = std::thread::spawn({
            let starting = starting.clone();
            move || forget_if_never_started(&starting)
        });
        other.join().unwrap();
        assert!(starting.path.exists(), "another vmctl is starting it");
    }

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

    /// A VM directory in `dir` and its supervisor, started as vmctl starts one: a
    /// stand-in that runs until killed and never writes its pid file itself.
    fn silent_supervisor(dir: &Path) -> (VmDir, std::process::Child) {
        let vm = VmDir {
            path: dir.join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let exe = dir.join("vmctl");
        crate::vmm_process::script(&exe, "#!/bin/sh\nwhile :; do sleep 0.1; done\n");
        let supervisor = {
            let _forking = crate::state::no_forks_meanwhile();
            spawn_supervisor_from(&exe, &vm).unwrap()
        };
        (vm, supervisor)
    }

    /// A session after the start that saw the agent answer skips asking it again, but
    /// only while that very supervisor runs.
    #[test]
    fn a_start_whose_agent_answered_is_known_by_its_supervisor() {
        let dir = tempfile::tempdir().unwrap();
        let (vm, mut supervisor) = silent_supervisor(dir.path());
        let pid = supervisor.id() as i32;
        assert_eq!(vm.running_pid(), Some(pid));
        assert!(!agent_answered_for(&vm, pid), "nothing answered yet");
        mark_agent_answered(&vm);
        let answered = agent_answered_for(&vm, pid);
        // The same pid, another process (a pid reused since).
        std::fs::write(vm.path.join(AGENT_ANSWERED), format!("{pid} 1")).unwrap();
        let reused = agent_answered_for(&vm, pid);
        mark_agent_answered(&vm);
        let _ = supervisor.kill();
        let _ = supervisor.wait();
        assert!(answered);
        assert!(!reused, "another process of that pid counted");
        assert!(!agent_answered_for(&vm, pid), "a supervisor gone counted");
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

    #[test]
    fn builds_from_where_a_vm_writes_are_found() {
        let writable = [PathBuf::from("/home/u/src"), PathBuf::from("/data")];
        let found = builds_within(
            Path::new("/home/u/src/vmctl"),
            Some(PathBuf::from("/data/recipe.toml")),
            &writable,
        );
        let found: Vec<(&str, &Path)> = found
            .iter()
            .map(|(what, _, share)| (*what, share.as_path()))
            .collect();
        assert_eq!(
            found,
            [
                ("vmctl's sources", Path::new("/home/u/src")),
                ("the recipe", Path::new("/data"))
            ]
        );
        assert!(builds_within(Path::new("/opt/vmctl"), None, &writable).is_empty());
        // A sibling that only shares a prefix of characters is not inside.
        assert!(builds_within(Path::new("/home/u/src2/vmctl"), None, &writable).is_empty());
    }

    #[test]
    fn a_supervisors_warnings_are_found_in_its_log() {
        let log = "vmctl: supervising the VM of /w\n\
                   vmctl: warning: virtiofsd runs without its sandbox because ...\n\
                   2026-12-05T15:00:00Z WARN vmm: vmctl: warning: not ours\n\
                   vmctl: note: virtiofsd runs as this user\n\
                   vmctl: warning: more than 2 directories in the shares: ...\n\
                   vmctl-vmm: warning: cannot jail the VMM (EPERM): ...\n";
        let warnings: Vec<&str> = warnings_in(log).collect();
        assert_eq!(
            warnings,
            [
                "vmctl: warning: virtiofsd runs without its sandbox because ...",
                "vmctl: warning: more than 2 directories in the shares: ...",
                "vmctl-vmm: warning: cannot jail the VMM (EPERM): ..."
            ]
        );
    }

    /// An error quotes the log's last lines even when one is not UTF-8.
    #[test]
    fn a_log_tail_survives_a_byte_that_is_not_text() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("supervisor.log");
        std::fs::write(
            &log,
            b"first\n\nthe guest said \xff\nvmctl: error: the end\n",
        )
        .unwrap();
        assert_eq!(
            log_tail(&log),
            ":\n  first\n  the guest said \u{fffd}\n  vmctl: error: the end\n"
        );
        assert_eq!(log_tail(&dir.path().join("missing")), "");
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
        let cmdline = agent_cmdline(&vm, &shares, Some("alice:1000:1000:/home/alice"));
        let (config, refused) = guest_agent::init::parse_cmdline(&cmdline);
        assert!(refused.is_empty(), "{cmdline}: {refused:?}");
        assert_eq!(config.hostname.as_deref(), Some("my-project.v2-c61c616e"));
        assert_eq!(config.user.map(|user| user.name).as_deref(), Some("alice"));
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
        // The root disk, rng, vsock and the balloon take 4 of the 19 slots.
        for index in 0..15 {
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
            guest: PathBuf::from("/s15"),
            read_only: false,
        });
        record.agent_cmdline = agent_cmdline(&vm, &set.shares, None);
        let error = check_config_fits(&vm, &record).unwrap_err().to_string();
        assert!(error.contains("16 shares"), "{error}");
        assert!(error.contains("need 20 virtio devices"), "{error}");
        assert!(error.contains("share 1 fewer"), "{error}");
        assert!(error.contains("free_page_reporting = false"), "{error}");

        // Without the balloon the same 16 shares fit.
        record.free_page_reporting = false;
        check_config_fits(&vm, &record).unwrap();
    }

    #[test]
    fn an_agent_of_another_protocol_is_told_apart_from_a_silent_one() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        assert_eq!(agent_state(&socket), AgentState::Silent, "no socket yet");
        let said = format!(
            "{} 5 (this agent 0.1.0 speaks 4)",
            guest_agent::protocol::UNSUPPORTED_VERSION
        );
        let agent = fake_agent(
            &socket,
            guest_agent::protocol::AgentMessage::Error {
                message: said.clone(),
            },
        );
        assert_eq!(agent_state(&socket), AgentState::OtherProtocol(said));
        agent.join().unwrap();
    }

    #[test]
    fn a_fresh_agent_newer_than_vmctl_says_vmctl_needs_rebuilding() {
        let said = |version: u32| {
            format!(
                "{} {} (this agent 0.1.0 speaks {version})",
                guest_agent::protocol::UNSUPPORTED_VERSION,
                guest_agent::protocol::PROTOCOL_VERSION
            )
        };
        let ours = guest_agent::protocol::PROTOCOL_VERSION;
        let newer = fresh_agent_mismatch(&said(ours + 1));
        assert!(newer.contains("vmctl is older than its sources"), "{newer}");
        assert!(
            newer.contains(&format!("speaks protocol {}", ours + 1)),
            "{newer}"
        );
        let older = fresh_agent_mismatch(&said(ours - 1));
        assert!(older.contains("agent image is stale"), "{older}");
        let unparsed = fresh_agent_mismatch("unsupported protocol version, oddly");
        assert!(unparsed.contains("oddly"), "{unparsed}");
    }

    #[test]
    fn vm_size_is_a_share_of_the_host_with_a_floor() {
        let unset = Resources::default();
        assert_eq!(size_from(unset, 8, 32 * 1024), (8, 3276));
        // A floor above the host's RAM (a config shared with a bigger machine, or the
        // default 1 GiB on a 1 GiB host): all of it, not a VM the VMM refuses.
        let floor = Resources {
            memory_min_mib: Some(16 * 1024),
            ..unset
        };
        assert_eq!(size_from(floor, 4, 7900), (4, 7900));
        assert_eq!(size_from(unset, 1, 970), (1, 970));
        // A host of more CPUs than the VMM gives a VM (a large server).
        assert_eq!(size_from(unset, 64, 32 * 1024).0, 64);
        assert_eq!(size_from(unset, 512, 32 * 1024).0, MAX_VCPUS);
        assert_eq!(size_from(unset, 2, 4 * 1024), (2, 1024));
        let set = Resources {
            cpus: Some(16),
            memory_percent: Some(50),
            memory_min_mib: Some(512),
            free_page_reporting: Some(false),
        };
        assert_eq!(size_from(set, 4, 2 * 1024), (4, 1024));
    }
}
