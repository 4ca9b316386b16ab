//! Workspace VMs: `vmctl up`, `ps`, `stop`, `rm`, and what `exec`/`shell` need to
//! find (or start) a workspace's VM.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmm::process::cpus::CpuSet;

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::cli::VmSetupArgs;
use crate::exec::AGENT_PORT;
use crate::host_kvm::KvmKind;
use crate::network::control::{self, ControlError, ControlRequest, ControlResponse};
use crate::shares::{self, Share, ShareError, ShareSet};
use crate::state::{EgressTestOptions, StateError, VmDir, VmRecord};
use crate::user_config::{Resources, UserConfig, UserConfigError};
use crate::virtiofsd::{self, VirtiofsdError};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(
        "the VM in {} still runs after it was told to stop (its supervisor, pid {pid}, \
         outlived SIGKILL, or started since); its directory is kept. Once that process is \
         gone (`ps -o pid,stat,wchan -p {pid}` shows where it is stuck; its log: {}), \
         'vmctl rm' again",
        .dir.display(),
        .log.display()
    )]
    StillRunning {
        dir: PathBuf,
        pid: i32,
        log: PathBuf,
    },
    #[error(
        "another vmctl started the VM in {} again each time `vmctl rm` stopped it ({times} \
         times); stop that vmctl (`vmctl ps` shows the VM starting), then 'vmctl rm' again",
        .dir.display()
    )]
    KeptStarting { dir: PathBuf, times: usize },
    #[error("cannot start the VM's supervisor: {0}")]
    Spawn(std::io::Error),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error("{}: in 'mounts': {source}; fix the file (or remove the line)", .config.display())]
    ConfigMount { config: PathBuf, source: ShareError },
    #[error(transparent)]
    UserConfig(#[from] UserConfigError),
    #[error(transparent)]
    Virtiofsd(#[from] VirtiofsdError),
    #[error("the VM's network setup failed: {0}")]
    Network(#[from] ControlError),
    #[error(
        "the VM of {} did not come up: {reason}; {}",
        .workspace.display(),
        how_to_read_logs(.workspace, .vm_dir)
    )]
    NotReady {
        workspace: PathBuf,
        reason: String,
        /// The VM's directory, which holds its logs.
        vm_dir: PathBuf,
    },
    #[error(
        "the VM of {} runs a guest agent of another protocol version ({agent_said}). {}",
        .workspace.display(),
        guest_agent::client::other_protocol_advice(.agent_said)
    )]
    OtherAgent {
        workspace: PathBuf,
        agent_said: String,
    },
    #[error(
        "the guest paths of the VM's shares do not fit the guest kernel's command line, \
         which carries them ({len} bytes; at most {max}): share fewer directories, mount \
         them at shorter guest paths (--mount HOST:GUEST), or use a workspace at a \
         shorter path"
    )]
    SharePathsTooLong { len: usize, max: usize },
    #[error("recipe {}: {source}; name an existing recipe file (see rootfs/README.md)", .path.display())]
    Recipe {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    GuestAccount(#[from] crate::guest_account::GuestAccountError),
}

/// How to read the logs of the VM in `vm_dir`, the VM of `workspace`, for an error:
/// `vmctl logs` finds a workspace's own VM, but not `vmctl run`'s throwaway one, whose
/// files are named instead.
fn how_to_read_logs(workspace: &Path, vm_dir: &Path) -> String {
    let vm = VmDir {
        path: vm_dir.to_path_buf(),
    };
    if vm.is_throwaway() {
        format!(
            "its logs: {} (the host side) and {} (the guest's console); `vmctl prune` \
             removes them",
            vm.supervisor_log().display(),
            vm.console_log().display()
        )
    } else {
        let workspace = shell_word(workspace);
        format!(
            "see `vmctl logs --supervisor {workspace}` (the host side) and `vmctl logs \
             {workspace}` (the guest's console), in {}",
            vm_dir.display()
        )
    }
}

/// `path` as one word of a shell command: quoted unless it holds only characters no
/// shell reads specially.
pub(crate) fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+,:@%=".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

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

/// Starts `vm`, a throwaway VM for `workspace` ([`VmDir::ephemeral`]) beside its
/// regular one (`vmctl run`).
pub fn up_ephemeral(workspace: &Path, vm: VmDir, setup: &VmSetupArgs) -> Result<VmDir, VmError> {
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
        guest: crate::agent::GUEST_AGENT_HOME.into(),
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
    let answered_before = vm
        .running_pid()
        .is_some_and(|pid| agent_answered_for(&vm, pid));
    if vm.running_pid().is_some() && !answered_before {
        // Running: it may still be booting (another vmctl started it). Never start a
        // second VM over it.
        let nested = vm.read_record().map_or(true, |record| record.nested);
        let boot_timeout = if nested {
            BOOT_TIMEOUT_NESTED
        } else {
            BOOT_TIMEOUT_DIRECT
        };
        let waiting_since = Instant::now();
        let deadline = waiting_since + boot_timeout;
        let mut said = false;
        loop {
            match agent_state(&vm.vsock_socket()) {
                AgentState::Answers => {
                    mark_agent_answered(&vm);
                    break;
                }
                AgentState::OtherProtocol(agent_said) => {
                    return Err(VmError::OtherAgent {
                        workspace,
                        agent_said,
                    })
                }
                AgentState::Silent => {}
            }
            if vm.running_pid().is_none() {
                break;
            }
            if vm.runs_an_older_layout() {
                return Err(VmError::NotReady {
                    workspace,
                    reason: "it was started by an older vmctl, which kept its vsock socket \
                             elsewhere ('vmctl stop' it, then start it again)"
                        .into(),
                    vm_dir: vm.path.clone(),
                });
            }
            if Instant::now() > deadline {
                return Err(VmError::NotReady {
                    workspace,
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
    let (cpus, memory_mib) = vm_size(request.config.resources_for(&workspace));
    let mut record = VmRecord {
        // Filled in last: a start refused for its shares must not first build them.
        kernel: PathBuf::new(),
        initrd: PathBuf::new(),
        rootfs: PathBuf::new(),
        nested_host_kernel: None,
        cpus,
        memory_mib,
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
    check_cmdline_fits(&vm, &record)?;
    warn_of_builds_from_guest_writable(&vm, &record, recipe);
    // The user waits for the VM from here: "agent ready after" counts the lookups of
    // its files too (builds, when there are some, show their own progress).
    let looked_up = Instant::now();
    boot_files(&mut record, recipe, artifacts::ensure)?;
    vm.write_record(&record)?;
    let started = Instant::now();
    let mut notice = crate::start_notice::StartNotice::on_terminal();
    let mut supervisor = spawn_supervisor(&vm)?;
    let boot_timeout = if nested {
        BOOT_TIMEOUT_NESTED
    } else {
        BOOT_TIMEOUT_DIRECT
    };
    let deadline = started + boot_timeout;
    loop {
        let not_ready = |reason: String| VmError::NotReady {
            workspace: workspace.clone(),
            reason,
            vm_dir: vm.path.clone(),
        };
        match agent_state(&vm.vsock_socket()) {
            AgentState::Answers => {
                mark_agent_answered(&vm);
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
        notice.update(&workspace, started.elapsed());
        std::thread::sleep(if nested {
            READY_POLL_NESTED
        } else {
            READY_POLL_DIRECT
        });
    }
    notice.clear();
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

/// Whether a `vmctl` holds `vm`'s lifecycle lock, i.e. is starting, stopping or
/// removing it now ([`lifecycle_lock_held_for`] says which).
pub(crate) fn lifecycle_lock_held(vm: &VmDir) -> bool {
    std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).is_ok_and(|file| held_by_another(&file))
}

/// What the holder of `vm`'s lifecycle lock does, if someone holds it: `vmctl ps` shows
/// "stopping" for a VM the daemon's idle stop or `vmctl stop` is taking down, not
/// "starting" (nor "running" while it still runs).
fn lifecycle_lock_held_for(vm: &VmDir) -> Option<LockHolder> {
    let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).ok()?;
    let holder = LockHolder::from_note(&read_note(&file));
    held_by_another(&file).then_some(holder)
}

/// [`lifecycle_lock_held_for`] a VM whose supervisor runs, asked without trying its
/// lock unless its note says a stop: trying takes a free lock for a moment, and a start
/// or the idle stop that comes in that moment would wait or put off its stop for
/// nothing (`vmctl ps` in a loop). A running VM's lock is its start's, noted
/// "starting", or a stopper's.
fn running_vm_stopped_by(vm: &VmDir) -> Option<LockHolder> {
    let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).ok()?;
    let holder = LockHolder::from_note(&read_note(&file));
    (holder != LockHolder::Starting && held_by_another(&file)).then_some(holder)
}

fn read_note(file: &std::fs::File) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut said = [0u8; 16];
    let read = file.read_at(&mut said, 0).unwrap_or(0);
    said[..read].to_vec()
}

fn held_by_another(file: &std::fs::File) -> bool {
    matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock))
}

/// The file in a VM's directory whose `flock` is the VM's lifecycle lock: whoever
/// starts, stops or removes the VM holds it, so that none of these interleave, and
/// notes in it which it does ([`LockHolder`]). Any new operation that must not run
/// beside those takes it too. The name is from when only a start took it; it stays, so
/// that an older vmctl and this one still exclude each other.
pub(crate) const LIFECYCLE_LOCK: &str = "start.lock";

/// Why a `vmctl` holds a VM's lifecycle lock, as it notes in the lock's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockHolder {
    Starting,
    Stopping,
    Removing,
}

impl LockHolder {
    fn note(self) -> &'static str {
        match self {
            LockHolder::Starting => "starting",
            LockHolder::Stopping => "stopping",
            LockHolder::Removing => "removing",
        }
    }

    /// A holder that noted nothing (an older vmctl, or between its lock and its note)
    /// is taken for a start, as before there were notes.
    fn from_note(note: &[u8]) -> LockHolder {
        [LockHolder::Stopping, LockHolder::Removing]
            .into_iter()
            .find(|holder| note.trim_ascii() == holder.note().as_bytes())
            .unwrap_or(LockHolder::Starting)
    }
}

/// Notes in `lock`, a held lifecycle lock, what its holder does, for `vmctl ps`; a note
/// that cannot be written only leaves `ps` saying "starting". Written over the last
/// one, then cut to its length, so that a reader never finds the file empty meanwhile.
pub(crate) fn note_lock_holder(lock: &std::fs::File, holder: LockHolder) {
    use std::os::unix::fs::FileExt;
    let note = holder.note().as_bytes();
    let noted = lock
        .write_all_at(note, 0)
        .and_then(|()| lock.set_len(note.len() as u64));
    if let Err(e) = noted {
        tracing::debug!("cannot note the start lock's holder: {e}");
    }
}

/// `vm`'s lifecycle lock if it comes free within `grace`; else a start is in progress,
/// not the daemon's idle stop finishing (which holds the lock until it has seen the VM
/// gone, a moment after `vmctl ps` does).
fn lock_lifecycle_within(vm: &VmDir, grace: Duration) -> Option<std::fs::File> {
    let deadline = Instant::now() + grace;
    loop {
        match try_lock_lifecycle(vm) {
            Ok(Some(lock)) => return Some(lock),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!("cannot take {}'s start lock: {e}", vm.path.display());
                return None;
            }
        }
    }
}

/// How long `vmctl prune` waits for a VM's lifecycle lock before it takes the VM for
/// one being started: longer than the daemon's idle stop holds it past the VM's end.
const STOP_LOCK_GRACE: Duration = Duration::from_secs(2);

/// `vm`'s lifecycle lock, unless someone holds it (`Ok(None)`). While it is held no
/// `vmctl` attaches to the VM or starts it: they wait in [`start`].
pub(crate) fn try_lock_lifecycle(vm: &VmDir) -> std::io::Result<Option<std::fs::File>> {
    let file = crate::state::open_lock_file(&vm.path.join(LIFECYCLE_LOCK))?;
    match file.try_lock() {
        Ok(()) => {
            // Not the last holder's note: what this one does, if it says.
            let _ = file.set_len(0);
            Ok(Some(file))
        }
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// vCPUs and MiB of a new VM: the config's, else one vCPU per CPU the VM may run on
/// and 10% of the host's RAM (at least 1 GiB).
fn vm_size(resources: Resources) -> (u32, u64) {
    let host_cpus = vm_cpu_count();
    let host_mib = host_memory_mib().unwrap_or(0);
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

/// `MemTotal` of /proc/meminfo, in MiB.
fn host_memory_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024)
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
    let text = std::fs::read_to_string(path).unwrap_or_default();
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

/// Refuses up front the shares whose guest paths the guest kernel's command line
/// cannot hold, which the VMM would refuse only once the supervisor runs.
fn check_cmdline_fits(vm: &VmDir, record: &VmRecord) -> Result<(), VmError> {
    let mut config = crate::supervisor::vm_config(vm, record);
    let share_count = record.shares.as_ref().map_or(0, |set| set.shares.len());
    // Each virtio-fs device adds its own parameter; the socket is not part of it.
    config.filesystems = (0..share_count)
        .map(|index| vmm::config::FsConfig {
            tag: shares::tag(index),
            socket_path: PathBuf::new(),
        })
        .collect();
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

/// One runtime for the agent calls of this process (`up` polls the agent every
/// 100 ms; building a runtime per poll is wasted start-up work).
fn agent_runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
        std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()
        })
        .as_ref()
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

/// Asks the guest to shut down, then waits for the supervisor; forces it after 30 s.
/// A start under way finishes first.
pub fn stop(workspace: &Path) -> Result<bool, VmError> {
    let (_, vm) = VmDir::lookup(workspace)?;
    let _lifecycle_lock = lock_to_stop(&vm, LockHolder::Stopping)?;
    Ok(stop_vm(&vm, "asked to by `vmctl stop`"))
}

/// `vm`'s lifecycle lock, held while a VM is started, stopped or removed, so that none
/// of these interleave. The directory is made if missing; one removed (by `vmctl rm`)
/// while this waited is made again, with a lock of its own: the lock of a removed
/// directory excludes nobody. `on_wait` runs (once) before it waits for another holder:
/// a boot, a kernel rebuild or the daemon's idle stop can take minutes.
fn lock_lifecycle(vm: &VmDir, on_wait: impl FnOnce()) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::MetadataExt;
    let path = vm.path.join(LIFECYCLE_LOCK);
    let io = |source| {
        VmError::State(StateError::Io {
            path: path.clone(),
            source,
        })
    };
    let mut on_wait = Some(on_wait);
    for _ in 0..10 {
        std::fs::create_dir_all(&vm.path).map_err(|source| {
            VmError::State(StateError::Io {
                path: vm.path.clone(),
                source,
            })
        })?;
        let file = crate::state::open_lock_file(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                if let Some(say) = on_wait.take() {
                    say();
                }
                file.lock().map_err(io)?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        let held = file.metadata().map(|m| (m.dev(), m.ino())).ok();
        let current = std::fs::metadata(&path).map(|m| (m.dev(), m.ino())).ok();
        if held.is_some() && held == current {
            note_lock_holder(&file, LockHolder::Starting);
            return Ok(file);
        }
    }
    Err(VmError::State(StateError::Io {
        path,
        source: std::io::Error::other("it was removed each time it was locked"),
    }))
}

/// `vm`'s lifecycle lock for `vmctl stop` or `rm` (`doing` it), so that no start runs
/// meanwhile: a start under way finishes first, and this says so. A start that still
/// holds the lock after [`STOP_WAITS_FOR_START`] while the VM runs only waits for its
/// agent (which a VM the nested host stalled never sends): the stop goes ahead without
/// the lock (`None`). `None` too when the VM's directory is gone.
pub(crate) fn lock_to_stop(
    vm: &VmDir,
    doing: LockHolder,
) -> Result<Option<std::fs::File>, VmError> {
    lock_to_stop_within(vm, doing, STOP_WAITS_FOR_START)
}

fn lock_to_stop_within(
    vm: &VmDir,
    doing: LockHolder,
    wait: Duration,
) -> Result<Option<std::fs::File>, VmError> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        if !vm.path.exists() {
            return Ok(None);
        }
        match try_lock_lifecycle(vm) {
            // Locked: unless `vmctl rm` removed the directory meanwhile.
            Ok(Some(lock)) => {
                note_lock_holder(&lock, doing);
                return Ok(vm.path.exists().then_some(lock));
            }
            Ok(None) if vm.running_pid().is_some() && Instant::now() >= deadline => {
                return Ok(None)
            }
            Ok(None) => {
                if !said {
                    vmm::to_stderr!(
                        "vmctl: the VM in {} is being started or stopped (another vmctl \
                         holds its start lock); {} it once that is done",
                        vm.path.display(),
                        doing.note()
                    );
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(VmError::State(StateError::Io {
                    path: vm.path.join(LIFECYCLE_LOCK),
                    source,
                }))
            }
        }
    }
}

/// How long `vmctl stop` or `rm` waits for a start under way of a VM that runs.
const STOP_WAITS_FOR_START: Duration = Duration::from_secs(10);

/// How the line that says who shut a VM down begins in its supervisor's log, where a
/// session that loses its VM finds it (and quotes what follows).
pub const SHUTDOWN_REQUESTED: &str = "vmctl: shutting the VM down: ";

/// Stops `vm`, first saying `why` in its supervisor's log; false when it was not
/// running. The guest is asked to shut down (again and again while its agent does not
/// answer yet, as when it still boots); after 30 s its supervisor is told to stop the
/// VMM, and killed if it has not within 10 s more. Returns once the supervisor is gone.
pub fn stop_vm(vm: &VmDir, why: &str) -> bool {
    stop_vm_within(vm, why, StopTimeouts::DEFAULT)
}

/// How long [`stop_vm`] gives the guest, then its supervisor after SIGTERM, then after
/// SIGKILL.
#[derive(Clone)]
struct StopTimeouts {
    guest: Duration,
    after_term: Duration,
    after_kill: Duration,
}

impl StopTimeouts {
    const DEFAULT: StopTimeouts = StopTimeouts {
        guest: Duration::from_secs(30),
        after_term: Duration::from_secs(10),
        after_kill: Duration::from_secs(5),
    };
}

fn stop_vm_within(vm: &VmDir, why: &str, timeouts: StopTimeouts) -> bool {
    let Some(pid) = vm.running_pid() else {
        return false;
    };
    let said = std::fs::OpenOptions::new()
        .append(true)
        .open(vm.supervisor_log())
        .and_then(|mut log| writeln!(log, "{SHUTDOWN_REQUESTED}{why}"));
    if let Err(e) = said {
        tracing::debug!("cannot note the shutdown in the supervisor's log: {e}");
    }
    let deadline = Instant::now() + timeouts.guest;
    let mut asked = false;
    while vm.running_pid().is_some() && Instant::now() < deadline {
        if !asked {
            match ask_guest_to_shut_down(vm, deadline.saturating_duration_since(Instant::now())) {
                ShutdownAsked::Yes => asked = true,
                ShutdownAsked::NotYet => {}
                ShutdownAsked::OtherAgent => {
                    // An agent older than the stable messages cannot be asked;
                    // waiting would only delay.
                    vmm::to_stderr!(
                        "vmctl: the VM in {} runs a guest agent too old to be asked to \
                         shut down; stopping its VMM",
                        vm.path.display()
                    );
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(if asked { 100 } else { 500 }));
    }
    if vm.running_pid().is_none() {
        return true;
    }
    if asked {
        vmm::to_stderr!(
            "vmctl: the VM in {} did not shut down; stopping its VMM",
            vm.path.display()
        );
    }
    for (signal, wait) in [
        (libc::SIGTERM, timeouts.after_term),
        (libc::SIGKILL, timeouts.after_kill),
    ] {
        if vm.running_pid() != Some(pid) {
            break;
        }
        // SAFETY: signalling the supervisor, whose pid `running_pid` has just checked
        // against its command line.
        unsafe { libc::kill(pid, signal) };
        let gone_by = Instant::now() + wait;
        while vm.running_pid().is_some() && Instant::now() < gone_by {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    true
}

enum ShutdownAsked {
    Yes,
    /// The agent did not answer (yet): the VM may still be booting.
    NotYet,
    /// Its agent speaks a protocol older than the stable messages.
    OtherAgent,
}

/// Asks `vm`'s guest agent to shut the guest down, waiting at most `limit` (and 10 s).
fn ask_guest_to_shut_down(vm: &VmDir, limit: Duration) -> ShutdownAsked {
    let Some(runtime) = agent_runtime() else {
        return ShutdownAsked::NotYet;
    };
    // An older layout's VM is asked where its socket is: waiting for one it never
    // makes would only delay its stop by the whole wait.
    let socket = if vm.runs_an_older_layout() {
        vm.older_layout_vsock_socket()
    } else {
        vm.vsock_socket()
    };
    runtime.block_on(async {
        let shutdown = async {
            // A VM another vmctl started is asked too, in its own protocol: its
            // commands get SIGTERM and the guest syncs, where cutting its power would
            // leave a guest `git`'s index.lock in the workspace.
            guest_agent::client::connect_hybrid_any_protocol(&socket, AGENT_PORT)
                .await?
                .shutdown()
                .await
        };
        match tokio::time::timeout(limit.min(Duration::from_secs(10)), shutdown).await {
            Ok(Ok(_)) => ShutdownAsked::Yes,
            Ok(Err(guest_agent::client::ClientError::OtherProtocol(_))) => {
                ShutdownAsked::OtherAgent
            }
            _ => ShutdownAsked::NotYet,
        }
    })
}

/// Stops the VM and removes its state; false when the workspace has none.
pub fn remove(workspace: &Path) -> Result<bool, VmError> {
    let (_, vm) = VmDir::lookup(workspace)?;
    remove_within(&vm, STOP_WAITS_FOR_START, StopTimeouts::DEFAULT)
}

/// How many times `vmctl rm` stops a VM that a start holding its lock boots again.
const REMOVAL_STOPS: usize = 3;

/// [`remove`] of `vm`, waiting `wait` for a start under way of a running VM (as
/// [`lock_to_stop_within`]), stopping within `timeouts`. The directory is emptied only
/// under the lifecycle lock: a start that held it past `wait` was waiting for the
/// running VM's agent, and once the VM is stopped goes on to boot it again (a `vmctl
/// exec` queued behind a hung VM), writing into the directory the removal empties. So
/// the VM is stopped first without the lock, then the lock waited for again, and
/// whatever that start booted stopped under it.
fn remove_within(vm: &VmDir, wait: Duration, timeouts: StopTimeouts) -> Result<bool, VmError> {
    const WHY: &str = "asked to by `vmctl rm`";
    let mut lock = lock_to_stop_within(vm, LockHolder::Removing, wait)?;
    for _ in 0..REMOVAL_STOPS {
        if lock.is_some() || !vm.path.exists() {
            break;
        }
        stop_vm_within(vm, WHY, timeouts.clone());
        lock = lock_to_stop_within(vm, LockHolder::Removing, wait)?;
    }
    if !vm.path.exists() {
        return Ok(false);
    }
    let Some(_lifecycle_lock) = lock else {
        return Err(VmError::KeptStarting {
            dir: vm.path.clone(),
            times: REMOVAL_STOPS,
        });
    };
    stop_vm_within(vm, WHY, timeouts);
    remove_stopped(vm).map(|()| true)
}

/// Stops `vm` (saying `why`, as [`stop_vm`]) and removes its state; refuses while its
/// supervisor still runs.
pub fn remove_vm(vm: &VmDir, why: &str) -> Result<(), VmError> {
    stop_vm(vm, why);
    remove_stopped(vm)
}

/// Removes the state of `vm`, stopped; refuses while its supervisor still runs.
fn remove_stopped(vm: &VmDir) -> Result<(), VmError> {
    if let Some(pid) = vm.running_pid() {
        return Err(VmError::StillRunning {
            dir: vm.path.clone(),
            pid,
            log: vm.supervisor_log(),
        });
    }
    remove_dir(vm).map_err(|source| {
        VmError::State(StateError::Io {
            path: vm.path.clone(),
            source,
        })
    })
}

/// How the removal of `vmctl run`'s throwaway VM ended.
#[derive(Debug)]
pub enum Teardown {
    Done(Result<(), VmError>),
    /// A second SIGINT or SIGTERM (this one) came first.
    Interrupted(i32),
}

/// Removes `vm`, `vmctl run`'s throwaway VM, minding SIGINT and SIGTERM: the session
/// forwarded them to its command, and their handlers outlive it, so that without this
/// Ctrl-C would do nothing while a guest that does not shut down holds the removal up
/// to 45 s ([`stop_vm`]). A first signal stops the VMM now (SIGTERM to the supervisor,
/// which passes it on); a second ends the wait, leaving the VM to the daemon (it is
/// stopped once idle) and its directory to `vmctl prune`.
pub fn remove_throwaway(vm: &VmDir) -> Teardown {
    let removal = {
        let vm = vm.clone();
        move || remove_vm(&vm, "`vmctl run` removes its throwaway VM")
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::debug!("no runtime to mind signals on ({e}); removing the VM regardless");
            return Teardown::Done(removal());
        }
    };
    let outcome = runtime.block_on(async {
        let (signals, source) = crate::exec::signals_received();
        let outcome = remove_minding(vm, signals, removal).await;
        source.abort();
        outcome
    });
    // An interrupted removal is not waited for: the process ends with it.
    runtime.shutdown_background();
    outcome
}

/// Runs `removal` of `vm` until it is done or the second of `signals` comes; the
/// first has `vm`'s supervisor stop its VMM.
async fn remove_minding(
    vm: &VmDir,
    mut signals: tokio::sync::mpsc::Receiver<i32>,
    removal: impl FnOnce() -> Result<(), VmError> + Send + 'static,
) -> Teardown {
    let mut removal = tokio::task::spawn_blocking(removal);
    let mut stopping = false;
    loop {
        tokio::select! {
            removed = &mut removal => {
                return Teardown::Done(match removed {
                    Ok(removed) => removed,
                    Err(e) => std::panic::resume_unwind(e.into_panic()),
                });
            }
            Some(signal) = signals.recv() => {
                if stopping {
                    return Teardown::Interrupted(signal);
                }
                stopping = true;
                if let Some(pid) = vm.running_pid() {
                    vmm::to_stderr!(
                        "vmctl: stopping the throwaway VM's VMM now (once more, and vmctl \
                         leaves it to the daemon and `vmctl prune`)"
                    );
                    // SAFETY: signalling the supervisor, whose pid `running_pid` has just
                    // checked against its command line.
                    unsafe { libc::kill(pid, libc::SIGTERM) };
                }
            }
        }
    }
}

/// Removes the directory of `vm`, which no VM runs from, and its sockets' directory
/// when that is one of its own in /tmp ([`VmDir::sockets_dir`]).
fn remove_dir(vm: &VmDir) -> std::io::Result<()> {
    // The guest wrote parts of it (the agent homes), read-only directories included.
    let removed = match (vm.path.parent(), vm.path.file_name()) {
        (Some(parent), Some(name)) => crate::guest_writable::open_dir(parent)
            .and_then(|parent| crate::guest_writable::remove(parent, name)),
        _ => std::fs::remove_dir_all(&vm.path),
    };
    // Its last run removed its sockets, but an older vmctl kept virtiofsd's logs
    // there too, and so the directory, one more in /tmp at each `vmctl run`.
    let sockets = vm.sockets_dir();
    if sockets != vm.path {
        match std::fs::remove_dir_all(&sockets) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => vmm::to_stderr!(
                "vmctl: warning: cannot remove the VM's sockets directory {}: {e}",
                sockets.display()
            ),
        }
    }
    removed
}

/// `vmctl prune`: removes those of `vms` that are stopped and whose workspace
/// directory is gone, that were throwaway VMs of a `vmctl run` that did not end well,
/// or whose start was refused before the VM was recorded (or, with `dry_run`, lists
/// them), saying what it did; names the running ones of removed directories, which it
/// leaves. Exits 1 if a removal failed.
pub fn prune(vms: &[VmDir], dry_run: bool) -> u8 {
    let mut failed = false;
    let mut forgotten = 0;
    for vm in vms {
        let untouched = untouched_for(vm, UNSTARTED_AGE);
        let modified = std::fs::metadata(&vm.path).and_then(|m| m.modified()).ok();
        let had_lock_file = vm.path.join(LIFECYCLE_LOCK).exists();
        // Held from the check to the removal: a start that comes meanwhile (Paseo
        // making a worktree again at the same path) waits, and is not removed under.
        let Some(_lifecycle_lock) = lock_lifecycle_within(vm, STOP_LOCK_GRACE) else {
            continue;
        };
        // Making the lock's file must not make the directory look fresh to the next
        // prune (or a dry run's to this one).
        if let (false, Some(modified)) = (had_lock_file, modified) {
            let restored = std::fs::File::open(&vm.path).and_then(|dir| dir.set_modified(modified));
            if let Err(e) = restored {
                tracing::debug!("cannot restore {}'s time: {e}", vm.path.display());
            }
        }
        let Some(what) = prunable(vm, untouched) else {
            continue;
        };
        if dry_run {
            vmm::to_stderr!("vmctl: would forget {what} ({})", vm.path.display());
            forgotten += 1;
            continue;
        }
        match remove_vm(vm, "`vmctl prune` forgets it") {
            Ok(()) => {
                forgotten += 1;
                vmm::to_stderr!("vmctl: forgot {what}");
            }
            Err(e) => {
                failed = true;
                vmm::to_stderr!("vmctl: error: {e}");
            }
        }
    }
    if dry_run {
        vmm::to_stderr!("vmctl: {forgotten} VM(s) would be forgotten");
    } else {
        vmm::to_stderr!("vmctl: {forgotten} VM(s) forgotten");
    }
    u8::from(failed)
}

/// What `vmctl prune` would forget `vm` as, if it would.
/// The caller holds `vm`'s lifecycle lock; `untouched`: whether its directory had not
/// changed for [`UNSTARTED_AGE`] before that.
fn prunable(vm: &VmDir, untouched: bool) -> Option<String> {
    let stopped = || vm.running_pid().is_none();
    let record = match vm.read_record() {
        Ok(record) => record,
        // A start refused before it wrote the record (a bad --mount, say) left the
        // directory alone, which `vmctl ps` does not list. A recent one may be a start
        // that has not yet taken its lock.
        Err(_) if !vm.record_path().exists() && stopped() && untouched => {
            return Some("the directory of a VM that never started".into());
        }
        // An unreadable record is kept for whoever looks into it.
        Err(_) => return None,
    };
    let throwaway = vm.is_throwaway();
    let workspace = record.workspace.display();
    if !throwaway {
        match record.workspace.try_exists() {
            Ok(true) => return None,
            Ok(false) => {}
            // Perhaps only out of reach (a parent directory not readable, a dead
            // network mount): its agent sessions are kept. (A volume not mounted looks
            // removed: its mount point is an empty directory.)
            Err(e) => {
                vmm::to_stderr!(
                    "vmctl: cannot tell whether {workspace} is still there ({e}): its VM \
                     is kept, for a prune once it can be told ({} holds it)",
                    vm.path.display()
                );
                return None;
            }
        }
    }
    if !stopped() {
        if !throwaway {
            vmm::to_stderr!(
                "vmctl: the VM of {workspace} (removed) still runs: 'vmctl rm \
                 {workspace}' stops and forgets it"
            );
        }
        return None;
    }
    Some(if throwaway {
        format!("the throwaway VM of {workspace}")
    } else {
        format!("the VM of {workspace}")
    })
}

/// How long a VM directory without a record is left alone by `vmctl prune`.
const UNSTARTED_AGE: Duration = Duration::from_secs(60);

/// Whether `vm`'s directory has not changed for `age`.
fn untouched_for(vm: &VmDir, age: Duration) -> bool {
    std::fs::metadata(&vm.path)
        .and_then(|meta| meta.modified())
        .is_ok_and(|modified| modified.elapsed().is_ok_and(|elapsed| elapsed >= age))
}

/// `vmctl ps`: one line per VM, with what it holds and what keeps it running.
pub fn list() -> Vec<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let daemon = crate::daemon::client::status();
    let mut lines = vec![format!(
        "{:<28} {:<8} {:>8} {:<6} {:>4} {:>7} {:>7}  {:<30} WORKSPACE",
        "NAME", "STATE", "UPTIME", "MODE", "CPUS", "MEMORY", "HELD", "KEPT BY"
    )];
    // Why crashed VMs crashed, and why broken ones are, after the table.
    let mut notes = Vec::new();
    let mut of_removed_directories = 0;
    for vm in VmDir::all() {
        let name = vm
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let record = match vm.read_record() {
            Ok(record) => record,
            Err(error) => {
                if let Some((line, note)) = row_without_record(&vm, &name, &error) {
                    lines.push(line);
                    notes.extend(note);
                }
                continue;
            }
        };
        let pid = vm.running_pid();
        let uptime = match pid {
            Some(_) => format_duration(now.saturating_sub(record.started_at)),
            None => "-".into(),
        };
        let (state, crash) = run_state(&vm, pid);
        let held = pid
            .and_then(crate::procfs::tree_pss_kib)
            .map(|kib| format!("{}M", kib / 1024))
            .unwrap_or_else(|| "-".into());
        let kept_by = match (pid, &daemon) {
            (None, _) => "-".to_string(),
            (Some(_), None) => "no daemon".to_string(),
            (Some(_), Some(vms)) => kept_by(vms.iter().find(|v| v.vm_dir == vm.path)),
        };
        // Worktrees come and go (Paseo removes them): their VMs' state stays behind.
        let removed = !record.workspace.exists();
        of_removed_directories += usize::from(removed);
        lines.push(format!(
            "{name:<28} {state:<8} {uptime:>8} {:<6} {:>4} {:>7} {held:>7}  {kept_by:<30} {}{}",
            if record.nested { "nested" } else { "direct" },
            record.cpus,
            format!("{}M", record.memory_mib),
            record.workspace.display(),
            if removed { " (removed)" } else { "" }
        ));
        if let Some(crash) = crash {
            notes.push(format!("{name}: {crash} (its logs: {})", vm.path.display()));
        }
        if let Some(note) = pid.and_then(|pid| another_builds_vm(&name, pid)) {
            notes.push(note);
        }
    }
    if !notes.is_empty() {
        lines.push(String::new());
        lines.extend(notes);
    }
    if of_removed_directories > 0 {
        lines.push(String::new());
        lines.push(format!(
            "{of_removed_directories} VM(s) of directories since removed: `vmctl prune` \
             forgets the stopped ones, `vmctl rm DIR` one (its logs and agent transcripts \
             go with it)"
        ));
    }
    lines
}

/// `vmctl ps`'s note for the VM `name` whose supervisor, `pid`, runs another build of
/// vmctl than this one (started before an upgrade): it keeps that build's ways, its
/// guest agent's protocol among them, until it is started again.
fn another_builds_vm(name: &str, pid: i32) -> Option<String> {
    crate::procfs::runs_another_program(pid).then(|| {
        format!(
            "{name}: started by another build of vmctl (before an upgrade?), whose ways it \
             keeps: `vmctl stop` it and start it again to run this one's"
        )
    })
}

/// `vmctl ps`'s line for `vm`, named `name`, whose record could not be read
/// (`error`), and the note under the table that says why and what to do; no line for
/// a directory without a record and no start under way (`vmctl up` creates the
/// directory, then writes the record: a start refused before that, say for a bad
/// `--mount`, leaves no VM to list).
fn row_without_record(
    vm: &VmDir,
    name: &str,
    error: &StateError,
) -> Option<(String, Option<String>)> {
    if vm.record_path().exists() {
        Some((
            format!("{name:<28} broken"),
            Some(format!("{name}: {error}")),
        ))
    } else if lifecycle_lock_held(vm) {
        Some((format!("{name:<28} starting"), None))
    } else {
        None
    }
}

/// What `vmctl ps` says of `vm`, a VM with a record whose supervisor runs as `pid`,
/// and the crash its last run ended in, if that is what it shows.
fn run_state(vm: &VmDir, pid: Option<i32>) -> (&'static str, Option<String>) {
    let lock_holder = match pid {
        Some(_) => running_vm_stopped_by(vm),
        None => lifecycle_lock_held_for(vm),
    };
    match pid {
        // Going down, until its stopper lets go of the lock (the VM gone, or not yet).
        _ if lock_holder.is_some_and(|holder| holder != LockHolder::Starting) => {
            (lock_holder.map_or("stopping", LockHolder::note), None)
        }
        // A restart spends seconds, minutes for a rebuild of the guest agent, before
        // its supervisor runs: neither the stop nor the crash before is what goes on.
        None if lock_holder.is_some() => ("starting", None),
        None => match vm.read_crash() {
            Some(crash) => ("crashed", Some(crash)),
            None => ("stopped", None),
        },
        // A share's virtiofsd died: the VM runs but cannot reach those files.
        Some(_) if !vm.read_share_failures().is_empty() => ("degraded", None),
        Some(_) => ("running", None),
    }
}

/// What keeps a VM running, as the daemon sees it.
fn kept_by(status: Option<&crate::daemon::protocol::VmStatus>) -> String {
    let Some(status) = status else {
        return "untracked".into();
    };
    let mut reasons = status.leases.clone();
    if status.pinned {
        reasons.insert(0, "vmctl up".into());
    }
    match (reasons.is_empty(), status.stops_in_s) {
        (false, _) => reasons.join(", "),
        (true, Some(s)) => format!("idle, stops in {s}s"),
        (true, None) => "idle".into(),
    }
}

fn format_duration(seconds: u64) -> String {
    match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// An exclusive `flock` on `path` (created if missing), held until the file drops:
    /// another vmctl's lifecycle lock, without the directory checks of
    /// [`lock_lifecycle`].
    fn lock_exclusive(path: &Path) -> std::io::Result<std::fs::File> {
        crate::state::lock_file(path)
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

    /// A session after the start that saw the agent answer skips asking it again, but
    /// only while that very supervisor runs.
    #[test]
    fn a_start_whose_agent_answered_is_known_by_its_supervisor() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let exe = dir.path().join("vmctl");
        crate::vmm_process::script(&exe, "#!/bin/sh\nwhile :; do sleep 0.1; done\n");
        let mut supervisor = {
            let _forking = crate::state::no_forks_meanwhile();
            spawn_supervisor_from(&exe, &vm).unwrap()
        };
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
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        // A supervisor that never gets to write its pid file.
        let exe = dir.path().join("vmctl");
        crate::vmm_process::script(&exe, "#!/bin/sh\nwhile :; do sleep 0.1; done\n");
        let mut supervisor = {
            let _forking = crate::state::no_forks_meanwhile();
            spawn_supervisor_from(&exe, &vm).unwrap()
        };
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

    /// Serves one hybrid-vsock connection on `socket` as a guest agent that answers
    /// every Hello with `reply`.
    fn fake_agent(
        socket: &Path,
        reply: guest_agent::protocol::AgentMessage,
    ) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
        fake_agent_answering(socket, vec![reply])
    }

    /// Serves one hybrid-vsock connection on `socket` as a guest agent that answers
    /// the frames it is sent with `replies`, one each, in order; returns those frames'
    /// payloads.
    fn fake_agent_answering(
        socket: &Path,
        replies: Vec<guest_agent::protocol::AgentMessage>,
    ) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
        use std::io::{BufRead, Read, Write};
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut connect = String::new();
            reader.read_line(&mut connect).unwrap();
            let mut writer = stream;
            writer.write_all(b"OK 1\n").unwrap();
            let mut requests = Vec::new();
            for reply in replies {
                let mut length = [0u8; 4];
                reader.read_exact(&mut length).unwrap();
                let mut frame = vec![0u8; u32::from_le_bytes(length) as usize];
                reader.read_exact(&mut frame).unwrap();
                requests.push(frame);
                let frame = guest_agent::protocol::encode_frame(&reply).unwrap();
                writer.write_all(&frame).unwrap();
            }
            requests
        })
    }

    /// A VM an older vmctl started, its socket where that vmctl kept it, is asked to
    /// shut down there (not waited for at the new place until the stop's time is up).
    #[test]
    fn an_older_layouts_vm_is_asked_to_shut_down_where_its_socket_is() {
        use guest_agent::protocol::AgentMessage;
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let agent = fake_agent_answering(
            &vm.older_layout_vsock_socket(),
            vec![
                AgentMessage::HelloOk {
                    agent_version: "0.0.9".into(),
                    protocol_version: guest_agent::protocol::PROTOCOL_VERSION,
                },
                AgentMessage::Ok,
            ],
        );
        assert!(vm.runs_an_older_layout());
        assert!(matches!(
            ask_guest_to_shut_down(&vm, Duration::from_secs(5)),
            ShutdownAsked::Yes
        ));
        let requests = agent.join().unwrap();
        let shutdown =
            guest_agent::protocol::encode_frame(&guest_agent::protocol::ClientMessage::Shutdown)
                .unwrap();
        assert_eq!(requests[1], shutdown[4..], "not asked to shut down");
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
        check_cmdline_fits(&vm, &record).unwrap();
        share(&mut record, PathBuf::from("/data/").join("x".repeat(1800)));
        let error = check_cmdline_fits(&vm, &record).unwrap_err().to_string();
        assert!(error.contains("at most 2047"), "{error}");
        assert!(error.contains("--mount HOST:GUEST"), "{error}");
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
    fn prune_forgets_stopped_vms_of_removed_directories_and_refused_starts_only() {
        let dir = tempfile::tempdir().unwrap();
        let kept_workspace = dir.path().join("kept");
        std::fs::create_dir_all(&kept_workspace).unwrap();
        let vm_of = |name: &str, workspace: &Path| {
            let vm = VmDir {
                path: dir.path().join("vms").join(name),
            };
            std::fs::create_dir_all(vm.path.join("agent-home")).unwrap();
            vm.write_record(&crate::state::test_record(&vm, workspace))
                .unwrap();
            vm
        };
        let kept = vm_of("kept", &kept_workspace);
        let gone = vm_of("gone", &dir.path().join("removed-worktree"));
        // Whether its workspace is there cannot be told (a link loop on the way, as an
        // unreadable parent or a dead mount would): kept, with its agent sessions.
        std::os::unix::fs::symlink("loop", dir.path().join("loop")).unwrap();
        let unknown = vm_of("unknown", &dir.path().join("loop/ws"));
        let starting = vm_of("starting", &dir.path().join("removed-too"));
        // A `vmctl run` whose boot failed left its stopped throwaway VM behind.
        let throwaway = vm_of("kept-1a2b3c4d-run4242", &kept_workspace);
        let lifecycle_lock = lock_exclusive(&starting.path.join(LIFECYCLE_LOCK)).unwrap();
        // A start refused before it wrote a record; and one still going.
        let refused = VmDir {
            path: dir.path().join("vms/refused"),
        };
        std::fs::create_dir_all(refused.path.join("agent-home")).unwrap();
        let a_while_ago = std::time::SystemTime::now() - UNSTARTED_AGE;
        std::fs::File::open(&refused.path)
            .and_then(|dir| dir.set_modified(a_while_ago))
            .unwrap();
        let just_refused = VmDir {
            path: dir.path().join("vms/just-refused"),
        };
        std::fs::create_dir_all(&just_refused.path).unwrap();
        let unrecorded_start = VmDir {
            path: dir.path().join("vms/unrecorded"),
        };
        std::fs::create_dir_all(&unrecorded_start.path).unwrap();
        let unrecorded_lock = lock_exclusive(&unrecorded_start.path.join(LIFECYCLE_LOCK)).unwrap();
        let vms = [
            kept.clone(),
            gone.clone(),
            unknown.clone(),
            starting.clone(),
            throwaway.clone(),
            refused.clone(),
            just_refused.clone(),
            unrecorded_start.clone(),
        ];

        assert_eq!(prune(&vms, true), 0);
        assert!(gone.path.exists(), "a dry run removed it");
        assert_eq!(prune(&vms, false), 0);
        assert!(
            !gone.path.exists(),
            "the stopped VM of a removed directory is left"
        );
        assert!(!throwaway.path.exists(), "a stopped throwaway VM is left");
        assert!(
            unknown.path.exists(),
            "a VM whose workspace may be only out of reach was removed"
        );
        assert!(
            !refused.path.exists(),
            "a refused start's directory is left"
        );
        assert!(
            unrecorded_start.path.exists(),
            "a start in progress, not yet recorded, was removed"
        );
        assert!(
            just_refused.path.exists(),
            "a fresh directory without a record (a start about to lock it) was removed"
        );
        drop(unrecorded_lock);
        assert!(
            kept.path.exists(),
            "a VM of an existing directory was removed"
        );
        assert!(starting.path.exists(), "a VM being started was removed");
        drop(lifecycle_lock);
    }

    /// A stand-in supervisor of `vm` that ignores SIGTERM, as one stuck in its teardown.
    fn stuck_supervisor(vm: &VmDir) -> crate::state::FakeSupervisor {
        crate::state::fake_supervisor(vm, "trap '' TERM; while :; do sleep 0.05; done")
    }

    #[test]
    fn a_stop_returns_once_the_supervisor_is_gone_killing_it_if_need_be() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let mut supervisor = stuck_supervisor(&vm);
        let quick = StopTimeouts {
            guest: Duration::from_millis(300),
            after_term: Duration::from_millis(300),
            after_kill: Duration::from_secs(5),
        };
        assert!(stop_vm_within(&vm, "a test", quick));
        assert!(
            vm.running_pid().is_none(),
            "stop returned before it was gone"
        );
        let status = supervisor.0.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(remove_vm(&vm, "a test").is_ok());
        assert!(!vm.path.exists());
    }

    /// `vmctl rm` of a hung VM whose lifecycle lock a `vmctl exec` holds while it waits
    /// for the agent: the removal stops the VM without the lock, but empties the
    /// directory only once that start, which goes on to boot the VM again, has let go.
    /// (Review: it emptied the directory while the start wrote its new VM's record
    /// there.)
    #[test]
    fn a_removal_empties_the_directory_only_once_a_start_waiting_on_the_vm_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let _hung = crate::state::fake_supervisor(&vm, "while :; do sleep 0.05; done");
        let (locked, lock_taken) = std::sync::mpsc::channel();
        let starter = {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let _lock = lock_lifecycle(&vm, || {}).unwrap();
                locked.send(()).unwrap();
                while vm.running_pid().is_some() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                // The VM is gone: it boots a new one, writing its record.
                let booted = (0..10).all(|round| {
                    std::thread::sleep(Duration::from_millis(50));
                    std::fs::write(vm.path.join(format!("record-{round}")), "new").is_ok()
                });
                booted && vm.path.exists()
            })
        };
        lock_taken.recv().unwrap();
        let quick = StopTimeouts {
            guest: Duration::from_millis(200),
            after_term: Duration::from_secs(5),
            after_kill: Duration::from_secs(5),
        };
        let removed = remove_within(&vm, Duration::from_millis(200), quick).unwrap();
        assert!(
            starter.join().unwrap(),
            "the start's directory was emptied under it"
        );
        assert!(removed);
        assert!(!vm.path.exists());
    }

    /// `remove_minding` of a VM with this supervisor (`sh -c script`), given `signals`
    /// each after its delay; how it ended and how long it took.
    fn remove_throwaway_with_signals(
        script: &str,
        signals: &[(Duration, i32)],
    ) -> (Teardown, Duration, bool) {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm-run1"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let supervisor = crate::state::fake_supervisor(&vm, script);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let started = Instant::now();
        let outcome = runtime.block_on(async {
            let (sender, received) = tokio::sync::mpsc::channel(4);
            let signals = signals.to_vec();
            tokio::spawn(async move {
                for (delay, signal) in signals {
                    tokio::time::sleep(delay).await;
                    let _ = sender.send(signal).await;
                }
                std::future::pending::<()>().await
            });
            let removal = {
                let vm = vm.clone();
                move || remove_vm(&vm, "a test")
            };
            remove_minding(&vm, received, removal).await
        });
        let took = started.elapsed();
        let left = vm.path.exists();
        // A removal left running ends with its supervisor.
        drop(supervisor);
        runtime.shutdown_background();
        (outcome, took, left)
    }

    /// A guest that does not shut down holds a removal 30 s before its VMM is stopped:
    /// Ctrl-C during `vmctl run`'s removal of its VM stops it at once.
    #[test]
    fn a_signal_during_a_throwaway_vms_removal_stops_its_vmm_now() {
        let (outcome, took, left) = remove_throwaway_with_signals(
            "trap 'exit 0' TERM; while :; do sleep 0.05; done",
            &[(Duration::from_millis(300), libc::SIGINT)],
        );
        assert!(matches!(outcome, Teardown::Done(Ok(()))), "{outcome:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert!(!left, "the VM's directory is left");
    }

    /// A supervisor that does not stop either: a second signal ends the wait.
    #[test]
    fn a_second_signal_during_a_throwaway_vms_removal_ends_the_wait() {
        let (outcome, took, left) = remove_throwaway_with_signals(
            "trap '' TERM; while :; do sleep 0.05; done",
            &[
                (Duration::from_millis(300), libc::SIGINT),
                (Duration::from_millis(300), libc::SIGTERM),
            ],
        );
        assert!(
            matches!(outcome, Teardown::Interrupted(libc::SIGTERM)),
            "{outcome:?}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert!(left, "left to `vmctl prune`");
    }

    /// A VM directory too deep for socket paths has its sockets in /tmp: removing the
    /// VM removes that directory too, whatever an older vmctl left in it.
    #[test]
    fn removing_a_vm_removes_its_sockets_directory_in_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("x".repeat(100)).join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let sockets = vm.sockets_dir();
        assert_ne!(sockets, vm.path, "not deep enough for a directory in /tmp");
        vm.create_sockets_dir().unwrap();
        std::fs::write(crate::virtiofsd::log_path(&sockets, 0), "a log\n").unwrap();
        remove_vm(&vm, "a test").unwrap();
        assert!(!vm.path.exists());
        assert!(!sockets.exists(), "{} is left", sockets.display());
    }

    /// `vmctl ps` shows no pid: the error must, and where to read why.
    #[test]
    fn a_vm_that_outlives_its_stop_is_named_by_its_supervisors_pid() {
        let vm = VmDir {
            path: "/state/vms/w-1234abcd".into(),
        };
        let error = VmError::StillRunning {
            dir: vm.path.clone(),
            pid: 4242,
            log: vm.supervisor_log(),
        }
        .to_string();
        assert!(error.contains("pid 4242,"), "{error}");
        assert!(error.contains("-p 4242"), "{error}");
        assert!(
            error.contains("/state/vms/w-1234abcd/supervisor.log"),
            "{error}"
        );
        assert!(!error.contains("vmctl ps"), "{error}");
    }

    /// A VM that did not come up is followed by the commands that show its logs; a
    /// throwaway one (`vmctl run`), which `vmctl logs` does not reach, by its files.
    #[test]
    fn a_start_that_failed_says_how_to_read_the_vms_logs() {
        let error = |workspace: &str, vm_dir: &str| {
            VmError::NotReady {
                workspace: workspace.into(),
                reason: "the guest agent did not answer within 30 s".into(),
                vm_dir: vm_dir.into(),
            }
            .to_string()
        };
        let own = error("/src/app", "/state/vms/app-1234abcd");
        assert_eq!(
            own,
            "the VM of /src/app did not come up: the guest agent did not answer within 30 s; \
             see `vmctl logs --supervisor /src/app` (the host side) and `vmctl logs /src/app` \
             (the guest's console), in /state/vms/app-1234abcd"
        );
        let spaced = error("/src/it's mine", "/state/vms/it-s-mine-1234abcd");
        assert!(
            spaced.contains("`vmctl logs '/src/it'\\''s mine'`"),
            "{spaced}"
        );
        let throwaway = error("/src/app", "/state/vms/app-1234abcd-run4242");
        assert!(!throwaway.contains("vmctl logs"), "{throwaway}");
        assert!(
            throwaway.contains(
                "its logs: /state/vms/app-1234abcd-run4242/supervisor.log (the host side) and \
                 /state/vms/app-1234abcd-run4242/console.log"
            ),
            "{throwaway}"
        );
    }

    #[test]
    fn a_stop_waits_for_a_start_but_not_for_one_stuck_on_a_running_vm() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let wait = Duration::from_millis(300);
        assert!(
            lock_to_stop_within(&vm, LockHolder::Stopping, wait)
                .unwrap()
                .is_none(),
            "no VM"
        );
        assert!(!vm.path.exists(), "the stop made the VM's directory");
        std::fs::create_dir_all(&vm.path).unwrap();
        // A start under way (the VM not running yet) is waited for, however long.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        let stopper = {
            let vm = vm.clone();
            std::thread::spawn(move || {
                lock_to_stop_within(&vm, LockHolder::Stopping, wait).unwrap()
            })
        };
        std::thread::sleep(wait * 3);
        assert!(
            !stopper.is_finished(),
            "the stop did not wait for the start"
        );
        drop(starting);
        assert!(
            stopper.join().unwrap().is_some(),
            "the stop did not take the lock"
        );
        // One holding the lock while the VM runs (waiting for its agent) is not.
        let _supervisor = crate::state::fake_supervisor(&vm, "while :; do sleep 0.05; done");
        let _attaching = lock_lifecycle(&vm, || {}).unwrap();
        let started = Instant::now();
        assert!(lock_to_stop_within(&vm, LockHolder::Stopping, wait)
            .unwrap()
            .is_none());
        assert!(started.elapsed() < wait * 10);
    }

    /// A start that has to wait for another vmctl's start or stop says so before it
    /// waits, once; one that takes a free lock says nothing.
    #[test]
    fn a_start_waiting_for_the_lifecycle_lock_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let held = lock_lifecycle(&vm, || panic!("the lock was free")).unwrap();
        let (said, heard) = std::sync::mpsc::channel();
        let waiting = {
            let vm = vm.clone();
            std::thread::spawn(move || lock_lifecycle(&vm, move || said.send(()).unwrap()).unwrap())
        };
        heard
            .recv_timeout(Duration::from_secs(10))
            .expect("the waiting start said nothing");
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiting.is_finished(), "it did not wait for the lock");
        drop(held);
        let _started = waiting.join().unwrap();
        assert!(heard.try_recv().is_err(), "it said so more than once");
    }

    #[test]
    fn a_start_waiting_on_a_removed_vm_locks_the_directory_made_again() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let removing = lock_lifecycle(&vm, || {}).unwrap();
        let waiting = {
            let vm = vm.clone();
            std::thread::spawn(move || lock_lifecycle(&vm, || {}).unwrap())
        };
        std::thread::sleep(Duration::from_millis(200));
        // `vmctl rm` removes the directory, its lock file with it, then lets go.
        std::fs::remove_dir_all(&vm.path).unwrap();
        drop(removing);
        let started = waiting.join().unwrap();
        let held = started.metadata().unwrap().ino();
        let current = std::fs::metadata(vm.path.join(LIFECYCLE_LOCK))
            .unwrap()
            .ino();
        assert_eq!(held, current, "the start holds the lock of a removed file");
        assert!(
            try_lock_lifecycle(&vm).unwrap().is_none(),
            "the lock excludes nobody"
        );
    }

    #[test]
    fn a_start_is_in_progress_only_while_its_lock_is_held() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        assert!(!lifecycle_lock_held(&vm), "no lock file yet");
        let held = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert!(lifecycle_lock_held(&vm));
        drop(held);
        assert!(!lifecycle_lock_held(&vm), "a start that ended (or failed)");
    }

    /// A VM that crashed, or stopped, and is being started again (its supervisor not
    /// running yet, as while the guest agent is rebuilt) is shown starting.
    #[test]
    fn ps_shows_a_vm_being_restarted_as_starting() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        assert_eq!(run_state(&vm, None), ("stopped", None));
        std::fs::write(vm.crash_file(), "the guest kernel crashed: oops\n").unwrap();
        let crash = Some("the guest kernel crashed: oops".to_string());
        assert_eq!(run_state(&vm, None), ("crashed", crash.clone()));
        let starting = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert_eq!(run_state(&vm, None), ("starting", None));
        drop(starting);
        assert_eq!(run_state(&vm, None), ("crashed", crash));
        assert_eq!(run_state(&vm, Some(1)).0, "running");
    }

    /// A VM being stopped (by `vmctl stop`, or the daemon's idle stop) or removed is
    /// shown so while it still runs and until its stopper lets go of the lock; a start
    /// that takes the lock after that is shown starting again.
    #[test]
    fn ps_shows_a_vm_being_stopped_as_stopping_not_starting() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let stopping = lock_to_stop_within(&vm, LockHolder::Stopping, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        assert_eq!(run_state(&vm, Some(1)), ("stopping", None));
        assert_eq!(run_state(&vm, None), ("stopping", None));
        drop(stopping);
        assert_eq!(run_state(&vm, None), ("stopped", None));
        let removing = lock_to_stop_within(&vm, LockHolder::Removing, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        assert_eq!(run_state(&vm, Some(1)), ("removing", None));
        drop(removing);
        // The daemon's idle stop notes itself on the lock it takes.
        let idle_stop = try_lock_lifecycle(&vm).unwrap().expect("the lock");
        note_lock_holder(&idle_stop, LockHolder::Stopping);
        assert_eq!(run_state(&vm, Some(1)), ("stopping", None));
        drop(idle_stop);
        // The next holder's note replaces the last one's.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        assert_eq!(run_state(&vm, None), ("starting", None));
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
        drop(starting);
        // A holder that notes nothing (`vmctl prune`) is not taken for the last
        // holder, a stop.
        let stopping = lock_to_stop_within(&vm, LockHolder::Stopping, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        drop(stopping);
        let pruning = try_lock_lifecycle(&vm).unwrap().expect("the lock");
        assert_eq!(
            run_state(&vm, None),
            ("starting", None),
            "a holder that notes nothing"
        );
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
        drop(pruning);
        // A running VM's free lock is not taken just to look: its start's note
        // ("starting") says no stop is under way.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        drop(starting);
        let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert_eq!(read_note(&file), b"starting");
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
    }

    #[test]
    fn ps_points_out_a_vm_another_build_of_vmctl_runs() {
        assert_eq!(another_builds_vm("app", std::process::id() as i32), None);
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let note = another_builds_vm("app", other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        let note = note.expect("a note for a VM of another build");
        assert!(
            note.starts_with("app: started by another build of vmctl"),
            "{note}"
        );
    }

    /// A VM whose record cannot be read is listed as broken, with why and what to do
    /// under the table; a directory a refused start left is not listed.
    #[test]
    fn ps_says_why_a_vm_is_broken() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("app-1234abcd"),
        };
        std::fs::create_dir(&vm.path).unwrap();
        assert!(vm.read_record().is_err());
        let error = vm.read_record().unwrap_err();
        assert!(row_without_record(&vm, "app-1234abcd", &error).is_none());
        std::fs::write(vm.record_path(), "{ half a record").unwrap();
        let error = vm.read_record().unwrap_err();
        let (line, note) = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        assert_eq!(
            line.split_whitespace().collect::<Vec<_>>(),
            ["app-1234abcd", "broken"]
        );
        let note = note.expect("a note under the table");
        assert!(
            note.starts_with("app-1234abcd: ")
                && note.contains(&vm.record_path().display().to_string())
                && note.contains("unreadable VM record")
                && note.contains(&format!("delete {}", vm.path.display())),
            "{note}"
        );
        // The workspace `vmctl rm` needs, from the supervisor's log.
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /home/u/app\nvmctl: the VM ended: Ok(0)\n",
        )
        .unwrap();
        let error = vm.read_record().unwrap_err();
        let (_, note) = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        let note = note.unwrap();
        assert!(
            note.contains("remove it with `vmctl rm /home/u/app`"),
            "{note}"
        );
    }

    #[test]
    fn prune_waits_out_a_lifecycle_lock_held_a_moment_past_the_vms_end() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let grace = Duration::from_secs(2);
        // The daemon's idle stop lets go of the lock just after the VM is gone.
        let held = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        let stop_ends = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        assert!(
            lock_lifecycle_within(&vm, grace).is_some(),
            "the stop's lock taken for a start"
        );
        stop_ends.join().unwrap();
        // A start holds it for longer.
        let _starting = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert!(lock_lifecycle_within(&vm, Duration::from_millis(300)).is_none());
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
        };
        assert_eq!(size_from(set, 4, 2 * 1024), (4, 1024));
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(5), "5s");
        assert_eq!(format_duration(125), "2m05s");
        assert_eq!(format_duration(7260), "2h01m");
    }
}
