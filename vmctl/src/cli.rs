//! Command-line interface.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use clap::builder::{OsStringValueParser, TypedValueParser};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "vmctl",
    version,
    about = "Run coding agents in lightweight KVM virtual machines",
    long_about = "Run coding agents in lightweight KVM virtual machines.\n\n\
        Where this machine's /dev/kvm cannot boot a Linux guest (no kvm_intel/kvm_amd, \
        e.g. PVM), vmctl runs its VMM inside a QEMU-TCG nested host instead, and says so.\n\n\
        Exit status: exec, run, shell, agent and nested-exec exit with their command's \
        code (128+N when signal N killed it, unless that signal came to vmctl, which then \
        dies of it too; 127 or 126 for a program the guest does not have or cannot run), \
        and with 125 when vmctl itself fails or their arguments are \
        wrong, so that a caller can tell the two apart. Every other command exits 0, 1 when \
        it fails, 2 for wrong arguments. 141: a reader of vmctl's output went away.",
    after_help = "Getting started, in a project directory:\n  \
        vmctl exec -- uname -a                            a command in its VM (started on demand)\n  \
        vmctl shell                                       a shell there, at the same path\n  \
        printenv ANTHROPIC_API_KEY | vmctl secret set anthropic\n  \
        vmctl agent claude                                Claude Code in the VM, signed in from the host"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command in the VM of a workspace, starting it if needed.
    ///
    /// Stdio is relayed; vmctl exits with the command's exit code (128+N for signal N),
    /// or 125 when vmctl itself fails.
    Exec(ExecArgs),
    /// A login shell in the VM of a workspace.
    ///
    /// Interactive, on a pseudo-terminal, when stdin is a terminal; otherwise, as with
    /// ssh, without one, reading its commands from stdin (`vmctl shell < script.sh`).
    /// Exits with the shell's code, or 125 when vmctl itself fails.
    Shell(ShellArgs),
    /// Run Claude Code or Codex in the VM of this directory's workspace.
    ///
    /// As on the host: same cwd, stdio relayed byte for byte (a PTY only when stdin
    /// and stdout are terminals), exit code and signals passed on; 125 when vmctl
    /// itself fails. This is the command Paseo's claude-vm and codex-vm providers run.
    Agent(AgentArgs),
    /// Start the VM of a workspace and keep it up until `vmctl stop`.
    ///
    /// Waits until its guest agent answers. A VM that `exec`, `shell` or `agent`
    /// started alone stops once idle (30 s after its last session, `idle_timeout_s` in
    /// the config file).
    Up(UpArgs),
    /// One-shot: a throwaway VM for the workspace, the command, teardown.
    ///
    /// Exits with the command's code, or 125 when vmctl itself fails.
    Run(ExecArgs),
    /// List workspace VMs.
    ///
    /// One line per VM: its state (running; degraded when a share's virtiofsd died;
    /// starting, while a start is under way before its supervisor runs; stopping or
    /// removing, from when `vmctl stop`, `rm` or the daemon's idle stop begins until
    /// it is done; stopped; crashed, with how its last run ended under the table; broken: its
    /// record cannot be read, said under the table, and `vmctl rm DIR` forgets it),
    /// uptime, mode (direct or nested), size, the host memory it holds and what keeps
    /// it running. --json prints the same as a JSON list, for scripts.
    Ps(PsArgs),
    /// A VM's console log, or its supervisor's (--supervisor).
    ///
    /// As `docker logs` shows a container's: the console holds what the guest agent
    /// logs (the boot, each command started and how it ended, clock steps, relays, the
    /// shutdown; a kernel's panic); the supervisor's log the host side's (shares,
    /// relays, why the VM stopped). Kept across a restart once, as --previous. Escape
    /// sequences from the guest are shown escaped.
    Logs(LogsArgs),
    /// Shut down the VM of a workspace.
    Stop(WorkspaceArg),
    /// Shut down the VM of a workspace and remove its state.
    ///
    /// Its logs go, and the Claude and Codex homes its agents used (their sessions,
    /// which `--resume` needs, and settings). On a terminal, asks first when agent
    /// sessions would go.
    Rm(RmArgs),
    /// Forget the VMs of removed directories and what failed runs left.
    ///
    /// The stopped VMs of workspace directories that no longer exist (removed
    /// worktrees), throwaway VMs a `vmctl run` left behind (their state, logs and agent
    /// transcripts), and the directories of starts refused before a VM was recorded
    /// (after a minute). Running ones are left (those of removed directories are
    /// named).
    Prune(PruneArgs),
    /// The TCP ports listening in the VM, and which are published on the host.
    ///
    /// Loopback-only ones included.
    Ports(WorkspaceArg),
    /// Make a port of the VM reachable on the host; prints the host address.
    ///
    /// Even one the guest binds to its loopback only.
    #[command(
        override_usage = "vmctl publish [OPTIONS] [DIR] <GUEST_PORT>",
        after_help = "Example: vmctl publish 3000   (a dev server in the VM, on a free host port)"
    )]
    Publish(PublishArgs),
    /// Stop publishing a port of the VM.
    #[command(override_usage = "vmctl unpublish [OPTIONS] [DIR] <GUEST_PORT>")]
    Unpublish(UnpublishArgs),
    /// Credentials the egress proxy adds to the guest's requests.
    ///
    /// The guest itself only sees placeholders.
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Which destinations the guest may reach through the egress proxy.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Paseo's providers for agents in VMs.
    #[command(subcommand)]
    Paseo(crate::paseo::PaseoCommand),
    /// The per-user daemon that stops idle VMs (started on demand).
    ///
    /// This runs it in the foreground. Stopping it stops every VM.
    Daemon(DaemonArgs),
    /// Run the benchmark harness.
    ///
    /// Boot time and memory side by side with QEMU's microvm, the workspace VM,
    /// virtio-fs, egress, agents: a JSON report on stdout and in
    /// target/bench/boot.json, the Markdown tables on stderr and in
    /// target/bench/boot.md, with PNG charts beside them. `--quick` is a smoke run.
    Bench(BenchArgs),
    /// Boot a guest kernel with its serial console on stdout (a developer's tool).
    ///
    /// Exits 0 when the guest reboots or shuts down.
    Boot(BootArgs),
    /// Run a command inside a fresh QEMU-TCG nested host (a developer's tool).
    ///
    /// It has a working /dev/kvm and sees this host's files read-only (for benchmarks
    /// and debugging). The command gets this environment, but for VMCTL_VCPU_CPUS: on
    /// the host it holds the nested host on those CPUs; inside, it is set to every CPU
    /// of the nested host but 0, where the VMMs the command starts run their guests.
    /// Exits with the command's code, or 125 when vmctl itself fails.
    NestedExec(NestedExecArgs),
    #[command(name = "__supervise", hide = true)]
    Supervise { dir: PathBuf },
}

/// The exit code of vmctl's own failure (a VM that would not start, wrong arguments)
/// in a command that exits with another program's code: 125, as docker and podman
/// use, which commands rarely use for themselves, so that a caller (a script, Paseo)
/// can tell "vmctl could not run it" from "it ran and failed with 1 or 2".
pub const OWN_FAILURE: u8 = 125;

impl Command {
    /// Whether its exit code is that of a command it runs.
    pub fn passes_exit_code_on(&self) -> bool {
        matches!(
            self,
            Command::Exec(_)
                | Command::Run(_)
                | Command::Shell(_)
                | Command::Agent(_)
                | Command::NestedExec(_)
        )
    }
}

/// Whether the command named `name` (a subcommand's name, as typed) exits with the
/// code of a command it runs: for its usage errors, which come before any [`Command`].
pub fn named_command_passes_exit_code_on(name: &OsStr) -> bool {
    ["exec", "run", "shell", "agent", "nested-exec"]
        .iter()
        .any(|command| name == *command)
}

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Add the CLI's own flag for running without approval prompts
    /// (--dangerously-skip-permissions, --dangerously-bypass-approvals-and-sandbox):
    /// the VM is the boundary.
    #[arg(long)]
    pub skip_permissions: bool,
    #[command(flatten)]
    pub isolation: IsolationArg,
    /// Which CLI, `claude` or `codex`, then its arguments, passed unchanged (bytes:
    /// they need not be UTF-8). Everything after the CLI's name is its own: `vmctl
    /// agent claude --help` is Claude's help.
    // One list, not a CLI then its arguments: clap would match vmctl's own options
    // (`--help`) right after the CLI's name before taking them as arguments.
    #[arg(
        value_name = "CLI [ARGS]",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub cli_and_args: Vec<OsString>,
}

impl AgentArgs {
    /// The CLI named first, and its arguments.
    pub fn cli(self) -> Result<(crate::agent::AgentCli, Vec<OsString>), String> {
        let mut words = self.cli_and_args.into_iter();
        let name = words.next().unwrap_or_default();
        let cli = name
            .to_str()
            .and_then(|name| clap::ValueEnum::from_str(name, false).ok())
            .ok_or_else(|| {
                let name = name.to_string_lossy();
                if name.starts_with('-') {
                    // What clap took for the name: an option `vmctl agent` lacks.
                    format!(
                        "unknown option '{name}' of 'vmctl agent' (see 'vmctl agent --help'); \
                         the CLI's own options come after its name"
                    )
                } else {
                    format!("'{name}' is not an agent CLI vmctl runs: name claude or codex")
                }
            })?;
        Ok((cli, words.collect()))
    }
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Few repetitions and small sizes: checks the harness works, not the numbers.
    #[arg(long)]
    pub quick: bool,
    /// More options for the harness (see `vmctl bench -- --help`).
    #[arg(last = true)]
    pub args: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    /// Stop the running daemon (and with it every VM) instead.
    #[arg(long)]
    pub stop: bool,
}

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// The workspace directory, optional (default: the current directory's VM, as
    /// for `vmctl stop`), then the port in the VM.
    #[arg(required = true, num_args = 1..=2, value_name = "[DIR] GUEST_PORT")]
    pub target: Vec<String>,
    /// The same as DIR, as `vmctl exec` takes it.
    #[arg(long = "workspace", value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// The host port (default: a free one, printed).
    #[arg(long, value_name = "N")]
    pub host_port: Option<u16>,
    /// The host address to listen on. A browser sends a page served at 127.0.0.1 the
    /// cookies of every other 127.0.0.1 service (ports do not count): give a server
    /// you do not trust an address of its own, such as 127.0.0.2.
    #[arg(long, value_name = "A", default_value = "127.0.0.1")]
    pub address: std::net::IpAddr,
}

#[derive(Debug, clap::Args)]
pub struct UnpublishArgs {
    /// The workspace directory, optional (default: the current directory's VM, as
    /// for `vmctl stop`), then the published port in the VM.
    #[arg(required = true, num_args = 1..=2, value_name = "[DIR] GUEST_PORT")]
    pub target: Vec<String>,
    /// The same as DIR, as `vmctl exec` takes it.
    #[arg(long = "workspace", value_name = "DIR")]
    pub workspace: Option<PathBuf>,
}

/// Splits `[DIR] GUEST_PORT`, the workspace given as DIR or as `--workspace DIR`.
pub fn dir_and_port(
    target: &[String],
    workspace: Option<PathBuf>,
) -> Result<(Option<PathBuf>, u16), String> {
    let (dir, port) = match (target, workspace) {
        ([port], workspace) => (workspace, port),
        ([dir, port], None) => (Some(PathBuf::from(dir)), port),
        ([dir, _], Some(workspace)) => {
            return Err(format!(
                "the workspace is given twice, as {dir:?} and as --workspace {}: give one",
                workspace.display()
            ))
        }
        _ => return Err("expected [DIR] GUEST_PORT".into()),
    };
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok((dir, port)),
        _ => Err(format!("{port:?} is not a port (1-65535)")),
    }
}

#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Store a secret, reading its value from stdin (never from the command line).
    /// Built-in names: anthropic (api.anthropic.com; x-api-key, or Authorization:
    /// Bearer for an OAuth token), openai (api.openai.com; Authorization: Bearer),
    /// github (github.com, api.github.com; git over HTTPS works). Any other name
    /// needs --host.
    #[command(after_help = "Example: printenv ANTHROPIC_API_KEY | vmctl secret set anthropic")]
    Set {
        /// anthropic, openai, github, or a name of your own.
        name: String,
        /// Send it only to this host (HOST, *.DOMAIN, optional :PORT; default port
        /// 443). Repeatable; replaces a built-in name's hosts.
        #[arg(long = "host", value_name = "H")]
        hosts: Vec<String>,
        /// The header that carries it: "Name" (the value as is) or "Name: template"
        /// with {} where the value goes, e.g. "Authorization: token {}". Default: the
        /// built-in name's; for another name, "Authorization: Bearer {}".
        #[arg(long, value_name = "HEADER")]
        header: Option<String>,
    },
    /// List the stored secrets: names, hosts and headers, never values.
    Ls,
    /// Remove a stored secret.
    Rm {
        /// Its name, as `vmctl secret ls` shows it.
        name: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct PolicyScope {
    /// Apply to every workspace instead of this one.
    #[arg(long, conflicts_with = "workspace")]
    pub global: bool,
    /// The workspace the rule is for (default: the current directory's, as for
    /// `vmctl stop`).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Allow destinations: HOST, *.DOMAIN (its subdomains), each with an optional
    /// :PORT. A deny rule still wins.
    Allow {
        /// HOST or *.DOMAIN, with an optional :PORT (without one, any port).
        #[arg(required = true, value_name = "PATTERN")]
        patterns: Vec<String>,
        #[command(flatten)]
        scope: PolicyScope,
    },
    /// Deny destinations (wins over every allow rule, defaults included).
    Deny {
        /// HOST or *.DOMAIN, with an optional :PORT (without one, any port).
        #[arg(required = true, value_name = "PATTERN")]
        patterns: Vec<String>,
        #[command(flatten)]
        scope: PolicyScope,
    },
    /// Remove rules you added (a default rule is overridden with `deny` instead).
    Rm {
        /// The rules' patterns, as `vmctl policy ls` shows them.
        #[arg(required = true, value_name = "PATTERN")]
        patterns: Vec<String>,
        #[command(flatten)]
        scope: PolicyScope,
    },
    /// The rules in force for a workspace: defaults, global and the workspace's own.
    Ls {
        /// The workspace (default: the current directory's, as for `vmctl stop`).
        #[arg(long, value_name = "DIR")]
        workspace: Option<PathBuf>,
    },
    /// The egress proxy's recent decisions for a workspace's VM.
    Log {
        /// The workspace (default: the current directory's, as for `vmctl stop`).
        #[arg(long, value_name = "DIR")]
        workspace: Option<PathBuf>,
        /// How many decisions.
        #[arg(long, short = 'n', default_value_t = 50)]
        lines: usize,
    },
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build (or find in the cache) a guest root image and print its path: the
    /// default one, or the one a recipe describes (see rootfs/README.md). Building one
    /// needs root: run as a user, the build script says how to run it through sudo.
    Build {
        /// A recipe file (JSON: name, debian_packages, npm_packages, script).
        #[arg(long, value_name = "FILE")]
        recipe: Option<PathBuf>,
    },
}

/// Directory shares beyond the workspace itself (when the VM starts) and host ports
/// relayed into it.
#[derive(Debug, Default, clap::Args)]
pub struct VmSetupArgs {
    /// Share a host directory with the VM, at GUEST (default: the same path),
    /// read-write unless ":ro" is given. Repeatable; more shares can be listed in
    /// ~/.config/vmctl/config.toml. The workspace itself is always shared read-write
    /// at its own path. Applies when this command starts the VM: a running VM keeps
    /// its shares (`vmctl stop` it first).
    #[arg(long = "mount", value_name = "HOST[:GUEST][:ro]")]
    pub mounts: Vec<String>,
    /// Relay the host's 127.0.0.1:PORT into the VM: a guest connection to its
    /// 127.0.0.1:PORT reaches it. Repeatable; also `relay_ports` in the config file.
    /// Paseo's port (6767) is relayed too, unless `relay_paseo = false` in the config
    /// file (a guest that reaches Paseo can start agents outside any VM).
    #[arg(long = "relay-port", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub relay_ports: Vec<u16>,
    #[command(flatten)]
    pub isolation: IsolationArg,
}

/// Which VM a directory belongs to when none is named.
#[derive(Debug, Default, clap::Args)]
pub struct IsolationArg {
    /// workspace: one VM per workspace (the nearest enclosing git repository or
    /// worktree, else the directory itself); directory: one VM per directory.
    /// Default: `isolation` in the config file, else workspace.
    #[arg(long, value_enum, value_name = "MODE")]
    pub isolation: Option<crate::workspace::Isolation>,
}

/// The workspace of a command that starts its VM (`up`, `shell`).
#[derive(Debug, clap::Args)]
pub struct StartWorkspaceArg {
    /// The workspace directory (default: the current directory's: see --isolation).
    dir: Option<PathBuf>,
    /// The same as DIR, as `vmctl exec` takes it.
    #[arg(long = "workspace", value_name = "DIR", conflicts_with = "dir")]
    workspace: Option<PathBuf>,
}

impl StartWorkspaceArg {
    /// The directory given, as DIR or as `--workspace DIR`.
    pub fn dir(&self) -> Option<PathBuf> {
        either(&self.dir, &self.workspace)
    }
}

#[derive(Debug, clap::Args)]
pub struct ShellArgs {
    #[command(flatten)]
    pub workspace: StartWorkspaceArg,
    #[command(flatten)]
    pub setup: VmSetupArgs,
}

#[derive(Debug, clap::Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub workspace: StartWorkspaceArg,
    #[command(flatten)]
    pub setup: VmSetupArgs,
    /// Boot the image built from this recipe (built first if needed, which needs
    /// root: see `vmctl image build`) instead of the default image.
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
    /// Testing only: trust the PEM CAs in FILE for the egress proxy's upstream TLS,
    /// besides the host's roots.
    #[arg(long, value_name = "FILE", hide = true)]
    pub egress_test_ca: Option<PathBuf>,
    /// Testing only: the egress proxy connects to ADDR for HOST:PORT instead of
    /// resolving it (skips the private-address check, not the policy). Repeatable.
    #[arg(long, value_name = "HOST:PORT=ADDR", hide = true, value_parser = parse_resolve)]
    pub egress_test_resolve: Vec<(String, std::net::SocketAddr)>,
}

/// A workspace given as DIR or as `--workspace DIR` (clap refuses both): the fields
/// stay private behind a `dir()` so that no caller reads one and misses the other.
fn either(dir: &Option<PathBuf>, workspace: &Option<PathBuf>) -> Option<PathBuf> {
    dir.as_ref().or(workspace.as_ref()).cloned()
}

fn parse_resolve(value: &str) -> Result<(String, std::net::SocketAddr), String> {
    let (target, addr) = value
        .split_once('=')
        .ok_or_else(|| format!("expected HOST:PORT=ADDR:PORT, got {value:?}"))?;
    let addr = addr
        .parse()
        .map_err(|e| format!("{addr:?} is not an address with a port: {e}"))?;
    match target.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok((target.to_ascii_lowercase(), addr))
        }
        _ => Err(format!("{target:?} is not HOST:PORT")),
    }
}

#[derive(Debug, clap::Args)]
pub struct WorkspaceArg {
    /// The workspace directory. Default: the current directory's VM: the nearest
    /// directory from here up to the workspace (see `vmctl up --isolation`) that has
    /// one, else that workspace.
    dir: Option<PathBuf>,
    /// The same as DIR, as `vmctl exec` takes it.
    #[arg(long = "workspace", value_name = "DIR", conflicts_with = "dir")]
    workspace: Option<PathBuf>,
}

impl WorkspaceArg {
    /// The directory given, as DIR or as `--workspace DIR`.
    pub fn dir(&self) -> Option<PathBuf> {
        either(&self.dir, &self.workspace)
    }
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    #[command(flatten)]
    pub workspace: WorkspaceArg,
    /// The supervisor's log (the host side of the VM) instead of the console.
    #[arg(long)]
    pub supervisor: bool,
    /// The log of the VM's run before this one (or before the last, if stopped).
    #[arg(long, conflicts_with = "follow")]
    pub previous: bool,
    /// Only the last N lines.
    #[arg(long, short = 'n', value_name = "N")]
    pub lines: Option<usize>,
    /// Keep printing what is logged until the VM stops (Ctrl-C ends it sooner).
    #[arg(long, short = 'f')]
    pub follow: bool,
}

#[derive(Debug, clap::Args)]
pub struct PsArgs {
    /// A JSON list, an object per VM (name, state, vm_dir, workspace,
    /// workspace_removed, mode, cpus, memory_mib, uptime_s, held_mib, kept_by, notes;
    /// null where a VM has none), instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct RmArgs {
    #[command(flatten)]
    pub workspace: WorkspaceArg,
    /// Do not ask, even on a terminal, before agent sessions are removed.
    #[arg(short, long)]
    pub force: bool,
}

#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Only list what would be removed.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// The workspace whose VM runs the command (default: the current directory's:
    /// see --isolation).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// Run the command on a pseudo-terminal (the host terminal goes raw).
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Give the command no input (end of file at once) and read none of vmctl's own
    /// stdin, as `ssh -n`: in `while read f; do vmctl exec -n -- cmd "$f"; done <
    /// list`, without it the first vmctl would take the rest of the list.
    #[arg(long = "no-stdin", short = 'n', conflicts_with = "tty")]
    pub no_stdin: bool,
    /// Set an environment variable for the command: K=V, or K alone for the host's
    /// value of K (as in the env file). Repeatable.
    #[arg(
        long = "env",
        short = 'e',
        value_name = "K=V",
        value_parser = OsStringValueParser::new().try_map(parse_env)
    )]
    pub env: Vec<(String, OsString)>,
    /// Run as this guest user ("root", or an account name); default: your host user.
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    #[command(flatten)]
    pub setup: VmSetupArgs,
    /// The command and its arguments (bytes: they need not be UTF-8).
    #[arg(required = true, trailing_var_arg = true)]
    pub command: Vec<OsString>,
}

fn parse_env(value: OsString) -> Result<(String, OsString), String> {
    parse_env_with(&value, |key| std::env::var_os(key))
}

/// `K=V` or `K`: the name is text (names must be portable), the value the bytes given
/// (or the host's), which need not be UTF-8.
fn parse_env_with(
    value: &OsStr,
    host: impl Fn(&str) -> Option<OsString>,
) -> Result<(String, OsString), String> {
    let bytes = value.as_bytes();
    let (key, val) = match bytes.iter().position(|&b| b == b'=') {
        Some(at) => (&bytes[..at], Some(&bytes[at + 1..])),
        None => (bytes, None),
    };
    let Ok(key) = std::str::from_utf8(key) else {
        return Err(format!(
            "the variable name in {value:?} is not UTF-8 (a value may be any bytes)"
        ));
    };
    match val {
        _ if key.is_empty() => Err(format!("expected K=V or K, got {value:?}")),
        Some(val) => Ok((key.to_string(), OsStr::from_bytes(val).to_os_string())),
        None => host(key)
            .map(|val| (key.to_string(), val))
            .ok_or_else(|| format!("{key} is not set here to pass on; write {key}=VALUE")),
    }
}

#[derive(Debug, clap::Args)]
pub struct NestedExecArgs {
    /// vCPUs of the nested host.
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Memory of the nested host in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    pub memory: u64,
    /// A host directory the command may write to (shared read-write). Repeatable.
    #[arg(long = "writable", value_name = "DIR")]
    pub writable: Vec<PathBuf>,
    /// The command and its arguments (UTF-8: the nested host's job is JSON).
    #[arg(required = true, trailing_var_arg = true)]
    pub command: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NestedMode {
    /// Nested host only where this machine's KVM cannot boot Linux.
    Auto,
    /// Always run through the QEMU-TCG nested host.
    Always,
    /// Never: use /dev/kvm directly, even if it cannot boot Linux.
    Never,
}

#[derive(Debug, clap::Args)]
pub struct BootArgs {
    /// Guest kernel (ELF vmlinux or bzImage). Default: the project's kernel, built
    /// on first use (kernel-config/build.sh).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk. Default without --kernel: the project's hello initramfs
    /// (rootfs/build-initramfs.sh); with --kernel: none.
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// Raw disk image, seen as /dev/vda, /dev/vdb, ... in the order given; append
    /// ":ro" to make it read-only. Repeatable.
    #[arg(long = "disk", value_name = "PATH[:ro]")]
    pub disks: Vec<String>,
    /// A virtio-fs device served by a vhost-user-fs backend (virtiofsd) already
    /// listening on SOCKET; the guest mounts it with `mount -t virtiofs TAG DIR`.
    /// Repeatable. Not with the nested host: the backend must run where the VMM runs.
    #[arg(long = "fs", value_name = "TAG:SOCKET")]
    pub filesystems: Vec<String>,
    /// Extra kernel command-line arguments, appended to the defaults
    /// ("console=ttyS0 reboot=k panic=1 quiet cpu_init_udelay=0" and the virtio-mmio
    /// devices).
    #[arg(
        long,
        value_name = "ARGS",
        default_value = "",
        hide_default_value = true
    )]
    pub cmdline: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = vmm::config::DEFAULT_VCPUS)]
    pub cpus: u32,
    /// Guest memory in MiB.
    #[arg(long, value_name = "MIB", default_value_t = vmm::config::DEFAULT_MEMORY_MIB)]
    pub memory: u64,
    /// Print how long the guest took to reach its init (it writes the boot timer).
    #[arg(long)]
    pub boot_time: bool,
    /// Leave out the virtio-balloon through which the guest gives back the memory it
    /// frees (free page reporting; the config key `free_page_reporting` of workspace
    /// VMs).
    #[arg(long)]
    pub no_free_page_reporting: bool,
    /// Leave out the virtio console (the guest's hvc0, where workspace VMs' guest agent
    /// writes its log); the kernel's console is the serial port either way.
    #[arg(long)]
    pub no_virtio_console: bool,
    /// Whether to run the VMM inside the QEMU-TCG nested host.
    #[arg(long, value_enum, default_value_t = NestedMode::Auto)]
    pub nested: NestedMode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_targets_are_an_optional_dir_then_a_port() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(dir_and_port(&args(&["8080"]), None), Ok((None, 8080)));
        assert_eq!(
            dir_and_port(&args(&["/w", "8080"]), None),
            Ok((Some(PathBuf::from("/w")), 8080))
        );
        assert!(dir_and_port(&args(&["/w"]), None)
            .unwrap_err()
            .contains("not a port"));
        assert!(dir_and_port(&args(&["0"]), None).is_err());
        // README: "Where a command takes `[DIR]`, `--workspace DIR` works too".
        assert_eq!(
            dir_and_port(&args(&["8080"]), Some("/w".into())),
            Ok((Some(PathBuf::from("/w")), 8080))
        );
        assert!(dir_and_port(&args(&["/a", "8080"]), Some("/b".into()))
            .unwrap_err()
            .contains("given twice"));
        use clap::Parser;
        for argv in [
            &["vmctl", "publish", "--workspace", "/w", "8080"][..],
            &["vmctl", "unpublish", "--workspace", "/w", "8080"],
        ] {
            let workspace = match Cli::try_parse_from(argv).map(|cli| cli.command) {
                Ok(Command::Publish(args)) => dir_and_port(&args.target, args.workspace),
                Ok(Command::Unpublish(args)) => dir_and_port(&args.target, args.workspace),
                other => panic!("{argv:?}: {other:?}"),
            };
            assert_eq!(workspace, Ok((Some(PathBuf::from("/w")), 8080)), "{argv:?}");
        }
    }

    #[test]
    fn resolve_overrides_need_a_host_port_and_an_address() {
        assert_eq!(
            parse_resolve("API.test:443=127.0.0.1:8443"),
            Ok(("api.test:443".into(), "127.0.0.1:8443".parse().unwrap()))
        );
        assert!(parse_resolve("api.test=127.0.0.1:1").is_err());
        assert!(parse_resolve("api.test:443=nowhere").is_err());
    }

    #[test]
    fn the_workspace_is_dir_or_workspace_dir_as_for_exec() {
        use clap::Parser;
        let parse = |argv: &[&str]| Cli::try_parse_from([&["vmctl"], argv].concat());
        for argv in [&["rm", "/w"][..], &["rm", "--workspace", "/w"]] {
            let Ok(Cli {
                command: Command::Rm(arg),
            }) = parse(argv)
            else {
                panic!("{argv:?} does not parse as rm");
            };
            assert_eq!(arg.workspace.dir(), Some(PathBuf::from("/w")), "{argv:?}");
        }
        let Ok(Cli {
            command: Command::Up(up),
        }) = parse(&["up", "--workspace", "/w"])
        else {
            panic!("up --workspace does not parse");
        };
        assert_eq!(up.workspace.dir(), Some(PathBuf::from("/w")));
        let both = parse(&["stop", "/a", "--workspace", "/b"]).unwrap_err();
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn a_mistyped_option_before_the_command_is_refused_not_run() {
        use clap::Parser;
        let parse = |argv: &[&str]| Cli::try_parse_from([&["vmctl"], argv].concat());
        for argv in [&["exec", "--tyy", "bash"][..], &["run", "--bogus", "true"]] {
            let error = parse(argv).unwrap_err();
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::UnknownArgument,
                "{argv:?}"
            );
        }
        let command = |argv: &[&str]| match parse(argv) {
            Ok(Cli {
                command: Command::Exec(exec),
            }) => exec.command,
            Ok(Cli {
                command: Command::Run(run),
            }) => run.command,
            other => panic!("{argv:?}: {other:?}"),
        };
        // The command's own options, after its name or after `--`, are its.
        assert_eq!(
            command(&["exec", "ls", "-la", "--tyy"]),
            ["ls", "-la", "--tyy"]
        );
        assert_eq!(
            command(&["exec", "--", "--odd-name", "-x"]),
            ["--odd-name", "-x"]
        );
        assert_eq!(
            command(&["run", "--", "sh", "-c", "true"]),
            ["sh", "-c", "true"]
        );
    }

    #[test]
    fn an_env_entry_is_a_value_or_the_hosts() {
        let latin1 = || OsStr::from_bytes(b"Jos\xe9").to_os_string();
        let host = |key: &str| match key {
            "EDITOR" => Some("vim".into()),
            "NAME" => Some(latin1()),
            _ => None,
        };
        let parse = |value: &[u8]| parse_env_with(OsStr::from_bytes(value), host);
        assert_eq!(parse(b"A=b=c"), Ok(("A".into(), "b=c".into())));
        assert_eq!(parse(b"EDITOR"), Ok(("EDITOR".into(), "vim".into())));
        assert!(parse(b"UNSET").unwrap_err().contains("UNSET=VALUE"));
        assert!(parse(b"=x").is_err());
        assert!(parse(b"").is_err());
        // A value is bytes, given or the host's; a name is text.
        assert_eq!(parse(b"NAME=Jos\xe9"), Ok(("NAME".into(), latin1())));
        assert_eq!(parse(b"NAME"), Ok(("NAME".into(), latin1())));
        assert!(parse(b"N\xc9=x").unwrap_err().contains("not UTF-8"));
        let parsed = Cli::try_parse_from([
            OsStr::new("vmctl"),
            OsStr::new("exec"),
            OsStr::new("-e"),
            OsStr::from_bytes(b"NAME=Jos\xe9"),
            OsStr::new("true"),
        ]);
        let Ok(Cli {
            command: Command::Exec(exec),
        }) = parsed
        else {
            panic!("{parsed:?}");
        };
        assert_eq!(exec.env, [("NAME".to_string(), latin1())]);
    }

    /// As ssh and docker exec do: a command's arguments that are not UTF-8 (a
    /// Latin-1 file name) are the command's to judge, and go to it byte for byte.
    #[test]
    fn arguments_that_are_not_utf8_are_passed_on_as_they_are() {
        fn bytes_of<T: AsRef<OsStr>>(args: &[T]) -> Vec<&[u8]> {
            args.iter().map(|arg| arg.as_ref().as_bytes()).collect()
        }
        let parse = |argv: &[&[u8]]| {
            let argv = argv.iter().map(|arg| OsStr::from_bytes(arg));
            Cli::try_parse_from(std::iter::once(OsStr::new("vmctl")).chain(argv))
                .unwrap_or_else(|e| panic!("refused: {e}"))
        };
        for argv in [
            &[&b"exec"[..], b"--", b"cat", b"caf\xe9.txt"][..],
            &[b"exec", b"cat", b"caf\xe9.txt"],
            &[b"run", b"--", b"cat", b"caf\xe9.txt"],
        ] {
            let (Cli {
                command: Command::Exec(args),
            }
            | Cli {
                command: Command::Run(args),
            }) = parse(argv)
            else {
                panic!("{argv:?}");
            };
            assert_eq!(bytes_of(&args.command), [&b"cat"[..], b"caf\xe9.txt"]);
        }
        let Cli {
            command: Command::Agent(agent),
        } = parse(&[b"agent", b"claude", b"-p", b"caf\xe9", b"--verbose"])
        else {
            panic!("not agent");
        };
        let (cli, args) = agent.cli().unwrap();
        assert_eq!(cli, crate::agent::AgentCli::Claude);
        assert_eq!(bytes_of(&args), [&b"-p"[..], b"caf\xe9", b"--verbose"]);
    }

    /// What follows the CLI's name is the CLI's, even vmctl's own options: `vmctl
    /// agent claude --help` is Claude's help. Before the name, they are vmctl's.
    #[test]
    fn an_agent_clis_arguments_are_all_its_own() {
        use clap::Parser;
        let parsed = |argv: &[&str]| {
            Cli::try_parse_from(std::iter::once("vmctl").chain(argv.iter().copied()))
        };
        let agent = |argv: &[&str]| match parsed(argv) {
            Ok(Cli {
                command: Command::Agent(agent),
            }) => agent,
            other => panic!("{argv:?} is no agent command: {other:?}"),
        };
        let args = agent(&[
            "agent",
            "--skip-permissions",
            "codex",
            "--help",
            "--skip-permissions",
        ]);
        assert!(args.skip_permissions);
        let (cli, args) = args.cli().unwrap();
        assert_eq!(cli, crate::agent::AgentCli::Codex);
        assert_eq!(args, ["--help", "--skip-permissions"]);
        assert_eq!(
            parsed(&["agent", "--help"]).map(drop).unwrap_err().kind(),
            clap::error::ErrorKind::DisplayHelp
        );
        assert!(agent(&["agent", "claud"])
            .cli()
            .unwrap_err()
            .contains("'claud' is not an agent CLI"));
        assert!(agent(&["agent", "--isolaton", "directory", "claude"])
            .cli()
            .unwrap_err()
            .contains("unknown option '--isolaton' of 'vmctl agent'"));
    }

    #[test]
    fn the_commands_that_pass_a_code_on_are_known_by_name() {
        use clap::Parser;
        for (argv, passes) in [
            (&["exec", "true"][..], true),
            (&["run", "true"], true),
            (&["shell"], true),
            (&["agent", "claude"], true),
            (&["nested-exec", "true"], true),
            (&["ps"][..], false),
            (&["up"], false),
            (&["boot"], false),
        ] {
            let cli = Cli::try_parse_from([&["vmctl"], argv].concat()).unwrap();
            assert_eq!(cli.command.passes_exit_code_on(), passes, "{argv:?}");
            assert_eq!(
                named_command_passes_exit_code_on(OsStr::new(argv[0])),
                passes,
                "{argv:?}"
            );
        }
    }

    #[test]
    fn the_cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
