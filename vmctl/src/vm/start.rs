//! Starting a workspace's VM: `vmctl up`, and what `exec`/`shell`/`run` do to find
//! or start their VM. The request's checks and the shares are here; the VM's size is
//! in `size.rs`, its boot files, kernel command line and the supervisor's start in
//! `launch.rs`, and the wait for the guest agent in `agent_wait.rs`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::artifacts;
use crate::cli::VmSetupArgs;
use crate::host_kvm::KvmKind;
use crate::network::control::{self, ControlError, ControlRequest, ControlResponse};
use crate::shares::{self, Share, ShareSet};
use crate::state::{EgressTestOptions, StateError, VmDir, VmRecord};
use crate::user_config::UserConfig;
use crate::virtiofsd;

use super::agent_wait::{agent_answered_for, wait_for_new_agent, wait_for_running_agent};
use super::launch::{
    agent_cmdline, boot_files, check_config_fits, drop_caches_param, spawn_supervisor,
};
use super::lock::{lock_lifecycle, try_lock_lifecycle};
use super::size::vm_size;
use super::stop::{remove_dir, remove_vm};
use super::VmError;

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

/// The host directories a guest can write, for what vmctl reads on the host to start
/// `workspace`'s VM (an agent's `--mcp-config`): the workspace, the writable shares
/// its VM gets from the config file (and a worktree's repository, which it shares),
/// and those every VM was last started with, running or not.
pub fn guest_writable_dirs(workspace: &Path) -> Vec<PathBuf> {
    let config = UserConfig::load().unwrap_or_default();
    guest_writable_dirs_among(workspace, &config, &VmDir::all())
}

fn guest_writable_dirs_among(workspace: &Path, config: &UserConfig, vms: &[VmDir]) -> Vec<PathBuf> {
    let mut own: Vec<Share> = shares::workspace_share(workspace).into_iter().collect();
    // A mount the config file gets wrong refuses the start; until then, not shared.
    let mounts = config.mounts_for(workspace).into_iter();
    own.extend(mounts.filter_map(|spec| {
        shares::parse_mount_as_written(&spec, workspace)
            .ok()
            .map(|mount| mount.share)
    }));
    if let Ok(Some(repository)) = crate::worktree::repository_share(workspace, &own) {
        own.push(repository);
    }
    let recorded = vms
        .iter()
        .filter_map(|vm| vm.read_record().ok()?.shares)
        .flat_map(|set| set.shares);
    let writable = own
        .into_iter()
        .chain(recorded)
        .filter(|share| !share.read_only);
    std::iter::once(workspace.to_path_buf())
        .chain(writable.map(|share| share.host))
        .collect()
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
        free_page_reporting: resources.reports_free_pages(),
        nested,
        agent_cmdline: agent_cmdline(&vm, &share_set.shares, request.guest_account.as_deref())
            + &drop_caches_param(&resources),
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        workspace: workspace.clone(),
        shares: Some(share_set),
        relay_ports: relays_for(&request.config, &workspace, relay_ports),
        egress: egress.cloned().unwrap_or_default(),
        vsock_socket: Some(vm.vsock_socket()),
        workspace_mount: shares::mounts::mount_point_of(&workspace),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a guest can write, for an agent's `--mcp-config`: any VM's writable
    /// shares, and the config file's for this workspace, though its VM never started.
    /// (Review: only this VM's last record counted, so a file another VM's guest
    /// wrote, or one of a share this VM had not yet, was read, and its ports relayed.)
    #[test]
    fn guest_writable_dirs_are_every_vms_and_the_configs_writable_shares() {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            path.canonicalize().unwrap()
        };
        let (workspace, others_share, mounted, read_only) = (
            path("ws"),
            path("shared"),
            path("mounted"),
            path("read-only"),
        );
        let other = VmDir {
            path: dir.path().join("vms/other"),
        };
        std::fs::create_dir_all(&other.path).unwrap();
        other
            .write_record(&crate::state::test_record(&other, &others_share))
            .unwrap();
        let config: UserConfig = toml::from_str(&format!(
            "mounts = [{:?}, \"{}:ro\"]",
            mounted.display().to_string(),
            read_only.display()
        ))
        .unwrap();
        let dirs = guest_writable_dirs_among(&workspace, &config, std::slice::from_ref(&other));
        for writable in [&workspace, &others_share, &mounted] {
            assert!(
                dirs.contains(writable),
                "{} left out: {dirs:?}",
                writable.display()
            );
        }
        assert!(!dirs.contains(&read_only), "{dirs:?}");
    }

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
}
