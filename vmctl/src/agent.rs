//! `vmctl agent claude|codex [ARGS...]`: the agent CLI inside the VM of the current
//! directory's workspace, as Paseo's providers launch it: cwd at the host path, stdio
//! relayed byte for byte (a PTY only when stdin and stdout are terminals), exit code and
//! signals propagated, loopback MCP URLs relayed, a per-VM config home.
//! "Agent" here is the coding agent's CLI (claude, codex), not `guest-agent`, the VM's PID 1.

use std::ffi::{OsStr, OsString};
use std::io::{ErrorKind, IsTerminal};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::exec::{self, ExecOptions};
use crate::guest_writable;
use crate::state::VmDir;

/// The largest MCP config file read (they are a few KiB).
const MAX_MCP_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// Where the VM's agent homes (a per-VM host directory) are mounted in the guest.
pub const AGENT_HOMES_IN_GUEST: &str = "/var/lib/vmctl/agent-home";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentCli {
    Claude,
    Codex,
}

impl AgentCli {
    pub fn program(self) -> &'static str {
        match self {
            AgentCli::Claude => "claude",
            AgentCli::Codex => "codex",
        }
    }

    /// The CLI's own flag for running without approval prompts (the VM is the
    /// boundary).
    fn skip_permissions_flag(self) -> &'static str {
        match self {
            AgentCli::Claude => "--dangerously-skip-permissions",
            AgentCli::Codex => "--dangerously-bypass-approvals-and-sandbox",
        }
    }

    /// The egress secret that signs it in.
    fn secret_name(self) -> &'static str {
        match self {
            AgentCli::Claude => "anthropic",
            AgentCli::Codex => "openai",
        }
    }

    /// The variable that points the CLI at its config home.
    fn home_variable(self) -> &'static str {
        match self {
            AgentCli::Claude => "CLAUDE_CONFIG_DIR",
            AgentCli::Codex => "CODEX_HOME",
        }
    }

    /// What of the user's own home the VM's copy starts with (copied at each session;
    /// the VM's changes never reach the user's files): instructions, then the
    /// directories of skills, agents, commands, rules or prompts.
    fn seeded_from_user_home(
        self,
    ) -> (
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
    ) {
        match self {
            AgentCli::Claude => (
                ".claude",
                &["CLAUDE.md"],
                &["skills", "agents", "commands", "rules"],
            ),
            AgentCli::Codex => (".codex", &["AGENTS.md"], &["prompts", "skills"]),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Vm(#[from] crate::vm::VmError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The session's error, with why its VM went away if it did
    /// ([`crate::lost_vm::explain`]).
    #[error("{0}")]
    Session(String),
    #[error("preparing the VM's {what} in {}: {source}", .path.display())]
    Home {
        what: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the env file {}: line {line}: {reason}", .path.display())]
    EnvFile {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("cannot read --mcp-config file {}: {source}", .path.display())]
    McpConfig {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct AgentOptions {
    /// The workspace whose VM runs it (the current directory is inside it).
    pub workspace: PathBuf,
    pub cli: AgentCli,
    pub skip_permissions: bool,
    /// Passed on as they are: bytes, which need not be UTF-8.
    pub args: Vec<OsString>,
}

/// Runs the agent CLI in the workspace VM of the current directory; returns its exit
/// code.
pub fn run(options: AgentOptions) -> Result<u8, AgentError> {
    crate::vm::check_workspace_ways(&options.workspace).map_err(for_agent)?;
    let (workspace, vm_dir) = VmDir::for_workspace(&options.workspace)?;
    // What a guest can write, this VM's or another's (its agents' home included).
    let mut guest_writable = crate::vm::guest_writable_dirs(&workspace);
    guest_writable.push(agent_home_dir(&vm_dir));
    let relay_ports = loopback_ports(&options.args, &guest_writable)?;
    warn_if_not_signed_in(options.cli);
    let _lease = crate::lease(&workspace, &format!("agent {}", options.cli.program()));
    let start = crate::vm::StartOptions {
        relay_ports: &relay_ports,
        quiet: true,
        ..crate::vm::StartOptions::default()
    };
    let vm = crate::vm::up(&workspace, &start).map_err(for_agent)?;
    let source = seed_source(user_config_home(options.cli), &guest_writable);
    seed_home(options.cli, &vm, source.as_deref())?;
    let here = crate::workspace::current_dir();
    let mut env: Vec<(String, OsString)> = crate::git_identity::guest_env(&vm, &here)
        .into_iter()
        .map(|(name, value)| (name, value.into()))
        .collect();
    if options.cli == AgentCli::Claude {
        // The VM is the sandbox: as root, Claude Code refuses to skip its permission
        // prompts (which Paseo's bypass modes ask for) unless told it runs in one.
        env.push(("IS_SANDBOX".to_string(), "1".into()));
    }
    env.extend(read_env_file(&env_file())?);
    env.extend(config_homes_env(&vm, &guest_agent::protocol::User::Default));
    let mut argv: Vec<OsString> = vec![options.cli.program().into()];
    if options.skip_permissions {
        argv.push(options.cli.skip_permissions_flag().into());
    }
    argv.extend(options.args);
    let cwd = Some(crate::exec::guest_cwd(&vm, &here));
    let options = ExecOptions {
        argv,
        env,
        cwd,
        user: exec::parse_user(None),
        // Output redirected to a file gets no terminal's line endings and escapes.
        tty: std::io::stdin().is_terminal() && std::io::stdout().is_terminal(),
        stdin: true,
    };
    crate::git_guard::watch(&vm, || exec::run(&vm.vsock_socket(), options))
        .map_err(|e| AgentError::Session(crate::lost_vm::explain(&vm, &e)))
}

/// A refused start as `vmctl agent` says it: its remedies name no option it lacks
/// ([`crate::shares::ShareError::for_agent`]).
fn for_agent(error: crate::vm::VmError) -> AgentError {
    match error {
        crate::vm::VmError::Share(e) => AgentError::Vm(crate::vm::VmError::Share(e.for_agent())),
        other => AgentError::Vm(other),
    }
}

const BOTH_CLIS: [AgentCli; 2] = [AgentCli::Claude, AgentCli::Codex];

/// The variables that point both CLIs at the VM's config homes, for every session
/// (`exec`, `shell`, `run`) of the default user or root: `claude` or `codex` run from a
/// shell keeps its transcripts, settings and memory where `vmctl agent` does, in the
/// VM's state directory, not in the guest's own home, which is memory and goes with
/// the VM. The homes are made first (Codex refuses a `CODEX_HOME` that is not there);
/// one that cannot be made is said, and its variable left out. Another guest account
/// (`--user NAME`) keeps its own: it could not write the homes.
pub fn config_homes_env(vm: &VmDir, user: &guest_agent::protocol::User) -> Vec<(String, OsString)> {
    if matches!(user, guest_agent::protocol::User::Named(_)) {
        return Vec::new();
    }
    BOTH_CLIS
        .into_iter()
        .filter(|cli| match open_config_home(vm, *cli) {
            Ok(_) => true,
            Err(e) => {
                vmm::to_stderr!("vmctl: warning: {e}");
                false
            }
        })
        .map(|cli| {
            let home = format!("{AGENT_HOMES_IN_GUEST}/{}", cli.program());
            (cli.home_variable().to_string(), home.into())
        })
        .collect()
}

/// `cli`'s config home in the VM's agent homes, made if it is not there, and the
/// agent homes' lock, taken to make it and held for as long as the caller keeps it.
fn open_config_home(
    vm: &VmDir,
    cli: AgentCli,
) -> Result<(std::os::fd::OwnedFd, std::fs::File), AgentError> {
    let homes = agent_home_dir(vm);
    std::fs::create_dir_all(&homes).map_err(home_error("agent homes", &homes))?;
    let lock = lock_agent_homes(vm).map_err(home_error("agent homes' lock", &vm.path))?;
    let home = guest_writable::open_dir(&homes)
        .and_then(|homes| guest_writable::ensure_dir(homes, cli.program()))
        .map_err(home_error("config home", &homes.join(cli.program())))?;
    Ok((home, lock))
}

/// An [`AgentError::Home`] for preparing `what` at `path`.
fn home_error(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> AgentError {
    let (what, path) = (what.to_string(), path.to_path_buf());
    move |source| AgentError::Home { what, path, source }
}

/// The host directory the VM's agent homes live in (shared at
/// [`AGENT_HOMES_IN_GUEST`]).
pub fn agent_home_dir(vm: &VmDir) -> PathBuf {
    vm.path.join("agent-home")
}

/// Held while a session refreshes what the host puts in `vm`'s agent homes: two
/// sessions starting at once (Paseo starting two agents in one workspace) would each
/// remove what the other was creating, and one would fail. Beside the homes, where the
/// guest cannot reach it.
pub fn lock_agent_homes(vm: &VmDir) -> std::io::Result<std::fs::File> {
    crate::state::lock_file(&vm.path.join("agent-home.lock"))
}

/// Says so when no secret signs the CLI in: it would then ask to log in inside the VM,
/// where its token would live.
fn warn_if_not_signed_in(cli: AgentCli) {
    let Some(files) = crate::network::guest_setup::EgressFiles::locate() else {
        return;
    };
    let name = cli.secret_name();
    match egress::secrets::SecretStore::load(files.secrets) {
        Ok(store) if !store.contains(name) => vmm::to_stderr!(
            "vmctl: warning: no '{name}' secret is stored, so vmctl signs {} in with \
             nothing (signing in inside the VM would leave the token there); `vmctl secret \
             set {name}` stores one, which the VM only ever sees a placeholder of",
            cli.program()
        ),
        _ => {}
    }
}

/// Where the VM's agents keep their sessions (Claude's transcripts, which `claude
/// --resume` reads; Codex's), those that hold any.
pub fn session_dirs(vm: &VmDir) -> Vec<PathBuf> {
    let home = agent_home_dir(vm);
    let Ok(home_dir) = crate::guest_writable::open_dir(&home) else {
        return Vec::new();
    };
    [
        (AgentCli::Claude.program(), "projects"),
        (AgentCli::Codex.program(), "sessions"),
    ]
    .into_iter()
    // The guest wrote these: a link anywhere below the home is not followed, and
    // counts for nothing.
    .filter(|(cli, sessions)| crate::guest_writable::holds_entries(&home_dir, &[cli, sessions]))
    .map(|(cli, sessions)| home.join(cli).join(sessions))
    .collect()
}

/// The user's own config home of `cli`, which the VM's is seeded from: where its
/// variable (`CLAUDE_CONFIG_DIR`, `CODEX_HOME`) points, as the CLI on the host finds
/// it, else `~/.claude` or `~/.codex`.
fn user_config_home(cli: AgentCli) -> Option<PathBuf> {
    config_home_of(
        cli,
        std::env::var_os(cli.home_variable()),
        user_home(),
        &crate::workspace::current_dir(),
    )
}

/// [`user_config_home`] where `cli`'s variable is `moved`, the user's home `home` and
/// the current directory `cwd` (against which a relative `moved` is taken).
fn config_home_of(
    cli: AgentCli,
    moved: Option<OsString>,
    home: Option<PathBuf>,
    cwd: &Path,
) -> Option<PathBuf> {
    let moved = moved.filter(|dir| !dir.is_empty()).map(|dir| cwd.join(dir));
    moved.or_else(|| Some(home?.join(cli.seeded_from_user_home().0)))
}

/// `config_home`, unless it lies in a directory some guest can write (a
/// `CLAUDE_CONFIG_DIR` in the workspace, as a direnv file sets it): there a guest
/// could make its instruction file a link to the user's key, which the seeding
/// follows once (for stow's links) and would copy into the VM. Said when so.
fn seed_source(config_home: Option<PathBuf>, guest_writable: &[PathBuf]) -> Option<PathBuf> {
    let config_home = config_home?;
    let real = crate::state::resolve_existing_part(&config_home);
    let Some(writable) = guest_writable.iter().find(|dir| real.starts_with(dir)) else {
        return Some(config_home);
    };
    vmm::to_stderr!(
        "vmctl: warning: the VM's agent gets no copy of the instructions and skills in {}: \
         it lies in {}, which a VM can write, so a link there could lead to any of your \
         files; move it out of the VM's shares to have it copied",
        config_home.display(),
        writable.display()
    );
    None
}

fn user_home() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

/// How much of each instruction file or skill directory a VM's agent home gets: far
/// more than instructions take, far less than a guest that can write one (shared into
/// some VM) could make of it.
const SEED_LIMITS: guest_writable::CopyLimits = guest_writable::CopyLimits {
    bytes: 128 << 20,
    entries: 20_000,
};

/// The file in a CLI's home that names what the last refresh copied there from the
/// user's, one name a line: what the user has since removed goes from the VM too,
/// and nothing else of the agent's own.
const SEEDED_LIST: &str = ".vmctl-seeded";

/// Refreshes the VM's copy of the user's instructions and skill directories (made
/// read-only, so what the agent in the VM changes is its own business, never the
/// user's); the VM's transcripts and settings beside them are kept, and so is an
/// instruction file or directory the agent made where the user has none (its memory,
/// its own subagents or skills): only what an earlier refresh copied is removed when
/// the user's is gone. The guest can write the agent homes: [`guest_writable`] keeps
/// its symlinks from leading these writes into the user's files.
/// `source` is the user's config home ([`user_config_home`]).
fn seed_home(cli: AgentCli, vm: &VmDir, source: Option<&Path>) -> Result<(), AgentError> {
    let home = agent_home_dir(vm).join(cli.program());
    let (home_dir, _refreshing) = open_config_home(vm, cli)?;
    let Some(source) = source else {
        return Ok(());
    };
    let (_, files, dirs) = cli.seeded_from_user_home();
    // Written by the guest as much as by us: it only says what may be removed, and
    // the guest may remove its own entries anyway.
    let seeded_before = guest_writable::read_file_in(&home_dir, Path::new(SEEDED_LIST), 64 << 10)
        .map(|(text, _)| text)
        .ok();
    // A home seeded before the list was kept: what looks like a copy was one.
    let was_seeded = |name: &str| match &seeded_before {
        Some(list) => list
            .split(|b| *b == b'\n')
            .any(|line| line == name.as_bytes()),
        None => guest_writable::looks_copied(&home_dir, name),
    };
    let mut seeded = String::new();
    for name in files.iter().chain(dirs.iter()) {
        let target = home.join(name);
        let from = source.join(name);
        let users = std::fs::symlink_metadata(&from).is_ok();
        if users || was_seeded(name) {
            guest_writable::remove(&home_dir, name).map_err(home_error(name, &target))?;
        }
        if users {
            seeded.push_str(name);
            seeded.push('\n');
            let left_out = copy_users(&from, &home_dir, name).map_err(home_error(name, &target))?;
            if left_out.count > 0 {
                vmm::to_stderr!(
                    "vmctl: warning: {} entries of {} were left out of the VM's copy ({}{})",
                    left_out.count,
                    from.display(),
                    left_out.reasons.join("; "),
                    if left_out.count > left_out.reasons.len() as u64 {
                        "; ..."
                    } else {
                        ""
                    }
                );
            }
        }
    }
    guest_writable::write_read_only(&home_dir, SEEDED_LIST, seeded.as_bytes())
        .map_err(home_error(SEEDED_LIST, &home.join(SEEDED_LIST)))?;
    Ok(())
}

/// Copies the user's `from` (an instruction file or skill directory) to `name` in
/// the CLI's home. A link there (stow's, to the user's dotfiles) is followed once:
/// what it leads to is copied, as any entry is, no further link followed (where it
/// leads may be a directory some VM can write, whose guest could have put a link to a
/// key there, to be copied here for it to read). A link that cannot be followed so is
/// copied as the link, and said: the guest has no such path.
fn copy_users(
    from: &Path,
    home_dir: &std::os::fd::OwnedFd,
    name: &str,
) -> std::io::Result<guest_writable::LeftOut> {
    use std::os::fd::AsFd;
    match guest_writable::open_link_target(from) {
        Ok(Some((dir, target))) => {
            return guest_writable::copy_read_only_at(
                dir.as_fd(),
                &target,
                home_dir,
                name,
                SEED_LIMITS,
            );
        }
        Ok(None) => {}
        Err(e) => vmm::to_stderr!(
            "vmctl: warning: {} is a link that vmctl does not follow ({}): the VM's \
             agents get the link itself, which leads nowhere in the VM; link it straight \
             to the file or directory, through no other link",
            from.display(),
            if e.raw_os_error() == Some(libc::ELOOP) {
                "another link is on its way".to_string()
            } else {
                e.to_string()
            }
        ),
    }
    guest_writable::copy_read_only(from, home_dir, name, SEED_LIMITS)
}

/// The user's env file: `env` beside the config file (`~/.config/vmctl/env`).
pub(crate) fn env_file() -> PathBuf {
    crate::user_config::config_path()
        .and_then(|p| p.parent().map(|d| d.join("env")))
        .unwrap_or_else(|| PathBuf::from("/nonexistent/vmctl/env"))
}

/// The variables the user forwards to agents: `KEY=VALUE` lines (optionally with
/// `export`, values optionally quoted), or a bare `KEY` to forward the host's value.
/// A missing file forwards nothing. Names are text; values are bytes, which need not
/// be UTF-8.
fn read_env_file(path: &Path) -> Result<Vec<(String, OsString)>, AgentError> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(AgentError::EnvFile {
                path: path.to_path_buf(),
                line: 0,
                reason: e.to_string(),
            })
        }
    };
    parse_env_file(&text, |key| std::env::var_os(key)).map_err(|(line, reason)| {
        AgentError::EnvFile {
            path: path.to_path_buf(),
            line,
            reason,
        }
    })
}

fn parse_env_file(
    text: &[u8],
    host: impl Fn(&str) -> Option<OsString>,
) -> Result<Vec<(String, OsString)>, (usize, String)> {
    let mut vars = Vec::new();
    for (index, line) in text.split(|&b| b == b'\n').enumerate() {
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with(b"#") {
            continue;
        }
        let line = line.strip_prefix(b"export ").unwrap_or(line).trim_ascii();
        let (key, value) = match line.iter().position(|&b| b == b'=') {
            Some(at) => (
                line[..at].trim_ascii(),
                Some(unquote(line[at + 1..].trim_ascii())),
            ),
            None => (line, None),
        };
        let valid = key
            .first()
            .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
            && key.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
        // A valid name is ASCII.
        let key = match std::str::from_utf8(key) {
            Ok(key) if valid => key,
            _ => {
                let key = OsStr::from_bytes(key);
                return Err((index + 1, format!("{key:?} is not a variable name")));
            }
        };
        if value.is_some_and(|value| value.contains(&0)) {
            return Err((index + 1, format!("the value of {key} holds a NUL byte")));
        }
        let value = value.map(|value| OsStr::from_bytes(value).to_os_string());
        if let Some(value) = value.or_else(|| host(key)) {
            vars.push((key.to_string(), value));
        }
    }
    Ok(vars)
}

fn unquote(value: &[u8]) -> &[u8] {
    for quote in [b'"', b'\''] {
        if let Some(inner) = value
            .strip_prefix(&[quote])
            .and_then(|v| v.strip_suffix(&[quote]))
        {
            return inner;
        }
    }
    value
}

/// Loopback ports named by URLs in the MCP configuration the arguments give: the
/// values of `--mcp-config` (Claude's SDK passes the servers inline or as files) and
/// Codex's `-c`/`--config mcp_servers.…` overrides, so those URLs work unchanged in
/// the VM. Nothing else: a URL in a prompt (`-p "why does localhost:5432 refuse?"`)
/// is no consent to open that port to the guest. A file in one of `guest_writable`
/// (or a link to one) is passed over, said: the guest could name any host loopback
/// port there (a database, a Docker socket) to be relayed.
///
/// Arguments are bytes: a `--mcp-config` path is used as it is, and the URLs (ASCII)
/// are looked for in each value read as text, where a byte that is not UTF-8 is
/// U+FFFD, never part of a URL's host or port. (The arguments themselves go to the
/// CLI unchanged.)
fn loopback_ports(args: &[OsString], guest_writable: &[PathBuf]) -> Result<Vec<u16>, AgentError> {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let mut texts: Vec<String> = Vec::new();
    let mut mcp_configs: Vec<&[u8]> = Vec::new();
    let mut iter = args.iter().map(|arg| arg.as_bytes());
    while let Some(arg) = iter.next() {
        if arg == b"--mcp-config" {
            // Claude's takes several values.
            mcp_configs.extend(iter.clone().take_while(|v| !v.starts_with(b"-")));
        } else if let Some(value) = arg.strip_prefix(b"--mcp-config=") {
            mcp_configs.push(value);
        } else if arg == b"-c" || arg == b"--config" {
            if let Some(value) = iter.clone().next() {
                if value.starts_with(b"mcp_servers") {
                    texts.push(text(value));
                }
            }
        } else if let Some(value) = arg.strip_prefix(b"--config=") {
            if value.starts_with(b"mcp_servers") {
                texts.push(text(value));
            }
        }
    }
    for value in mcp_configs {
        if value.trim_ascii_start().starts_with(b"{") {
            texts.push(text(value));
            continue;
        }
        let path = Path::new(OsStr::from_bytes(value));
        let Ok(real) = path.canonicalize() else {
            continue;
        };
        if guest_writable.iter().any(|dir| real.starts_with(dir)) {
            vmm::to_stderr!(
                "vmctl: warning: --mcp-config {} is where the VM can write: the loopback \
                 ports it names are not relayed to the host (keep it outside the \
                 workspace)",
                crate::terminal::one_line(&path.display().to_string())
            );
            continue;
        }
        // Resolved, outside every share: nothing on its way is the guest's. (Still
        // only a regular file is read.)
        let text = match guest_writable::read_file(&real, false, MAX_MCP_CONFIG_BYTES) {
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::InvalidData) => continue,
            read => read
                .and_then(|bytes| String::from_utf8(bytes).map_err(std::io::Error::other))
                .map_err(|source| AgentError::McpConfig {
                    path: path.to_path_buf(),
                    source,
                })?,
        };
        texts.push(text);
    }
    let mut ports: Vec<u16> = texts.iter().flat_map(|t| loopback_ports_in(t)).collect();
    ports.sort_unstable();
    ports.dedup();
    Ok(ports)
}

/// Ports of `http(s)://127.0.0.1:P`, `localhost:P` and `[::1]:P` URLs in `text`.
fn loopback_ports_in(text: &str) -> Vec<u16> {
    let mut ports = Vec::new();
    for scheme in ["http://", "https://", "ws://", "wss://"] {
        for (start, _) in text.match_indices(scheme) {
            let rest = &text[start + scheme.len()..];
            for host in ["127.0.0.1:", "localhost:", "[::1]:"] {
                if let Some(after) = rest.strip_prefix(host) {
                    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
                    if let Ok(port) = digits.parse::<u16>() {
                        if port > 0 {
                            ports.push(port);
                        }
                    }
                }
            }
        }
    }
    ports
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The user's config home is where the CLI's variable moves it, as the CLI on the
    /// host finds it. (Review: `~/.claude` and `~/.codex` always, so a user with
    /// `CODEX_HOME` set got none of their instructions in the VM, and no word of it.)
    #[test]
    fn the_users_config_home_follows_the_clis_variable() {
        let (home, cwd) = (Some(PathBuf::from("/home/u")), Path::new("/work"));
        assert_eq!(
            config_home_of(
                AgentCli::Codex,
                Some("/home/u/.config/codex".into()),
                home.clone(),
                cwd
            ),
            Some(PathBuf::from("/home/u/.config/codex"))
        );
        assert_eq!(
            config_home_of(AgentCli::Claude, Some("conf".into()), home.clone(), cwd),
            Some(PathBuf::from("/work/conf"))
        );
        assert_eq!(
            config_home_of(AgentCli::Claude, Some("".into()), home.clone(), cwd),
            Some(PathBuf::from("/home/u/.claude"))
        );
        assert_eq!(
            config_home_of(AgentCli::Codex, None, home, cwd),
            Some(PathBuf::from("/home/u/.codex"))
        );
        assert_eq!(config_home_of(AgentCli::Codex, None, None, cwd), None);
    }

    /// (Review: a `CLAUDE_CONFIG_DIR` in the workspace was seeded from, and the
    /// seeding follows its instruction file's link once: a guest that made it a link
    /// to the user's key had the key copied into the VM.)
    #[test]
    fn a_config_home_a_guest_can_write_seeds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let workspace = real.join("ws");
        std::fs::create_dir_all(workspace.join("conf")).unwrap();
        std::os::unix::fs::symlink(&workspace, real.join("link")).unwrap();
        let writable = [workspace.clone()];
        for inside in [
            workspace.join("conf"),
            workspace.join("not-made-yet/conf"),
            real.join("link/conf"),
        ] {
            assert_eq!(
                seed_source(Some(inside.clone()), &writable),
                None,
                "{inside:?}"
            );
        }
        let outside = real.join("home/.claude");
        assert_eq!(seed_source(Some(outside.clone()), &writable), Some(outside));
        assert_eq!(seed_source(None, &writable), None);
    }

    #[test]
    fn the_agent_sessions_a_removal_would_take_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let home = agent_home_dir(&vm);
        std::fs::create_dir_all(home.join("claude/projects")).unwrap();
        std::fs::create_dir_all(home.join("codex")).unwrap();
        assert!(session_dirs(&vm).is_empty(), "empty ones count");
        std::fs::write(home.join("claude/projects/s.jsonl"), "{}").unwrap();
        // The guest's link to a full directory elsewhere is no session of the VM's.
        std::os::unix::fs::symlink(home.join("claude/projects"), home.join("codex/sessions"))
            .unwrap();
        assert_eq!(session_dirs(&vm), [home.join("claude/projects")]);
        // Nor is a link higher up: the guest's codex home, a link to the user's own.
        let users = dir.path().join("user/.codex");
        std::fs::create_dir_all(users.join("sessions")).unwrap();
        std::fs::write(users.join("sessions/s.jsonl"), "{}").unwrap();
        std::fs::remove_dir_all(home.join("codex")).unwrap();
        std::os::unix::fs::symlink(&users, home.join("codex")).unwrap();
        assert_eq!(session_dirs(&vm), [home.join("claude/projects")]);
    }

    #[test]
    fn loopback_urls_in_inline_and_file_mcp_configs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mcp.json");
        std::fs::write(
            &file,
            r#"{"mcpServers":{"b":{"type":"http","url":"http://localhost:9100/mcp"}}}"#,
        )
        .unwrap();
        let args: Vec<OsString> = [
            "-p",
            "--output-format",
            "stream-json",
            "--mcp-config",
            r#"{"mcpServers":{"paseo":{"type":"http","url":"http://127.0.0.1:6767/mcp/agents?x=1","headers":{"Authorization":"Bearer t"}}}}"#,
            file.to_str().unwrap(),
            "--verbose",
            "-c",
            "mcp_servers.x.url=\"https://[::1]:7000/\"",
            "--config=mcp_servers.y.url=\"http://localhost:7100/\"",
            "see http://example.com:81/ and http://127.0.0.1:notaport/",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert_eq!(
            loopback_ports(&args, &[]).unwrap(),
            [6767, 7000, 7100, 9100]
        );
        let joined = [OsString::from(format!("--mcp-config={}", file.display()))];
        assert_eq!(loopback_ports(&joined, &[]).unwrap(), [9100]);

        // Only the MCP configuration counts: a URL in a prompt, or in another setting,
        // opens no port.
        let args: Vec<OsString> = [
            "-p",
            "why does http://localhost:5432/ refuse?",
            "-c",
            "model_provider_url=\"http://127.0.0.1:8000/\"",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert_eq!(loopback_ports(&args, &[]).unwrap(), Vec::<u16>::new());

        // Arguments that are not UTF-8: a file's path is a path, a URL is a URL.
        let latin1 = dir.path().join(OsStr::from_bytes(b"mcp-\xe9.json"));
        std::fs::write(&latin1, r#"{"url":"http://127.0.0.1:4100/"}"#).unwrap();
        let args = [
            OsString::from("--mcp-config"),
            latin1.clone().into_os_string(),
            OsStr::from_bytes(b"{\"caf\xe9\": \"http://localhost:4200/\"}").to_os_string(),
        ];
        assert_eq!(loopback_ports(&args, &[]).unwrap(), [4100, 4200]);

        // A FIFO (in the workspace, the guest's to make) is passed over, not waited on.
        let fifo = dir.path().join("fifo.json");
        guest_writable::make_fifo(&fifo);
        let args = [OsString::from("--mcp-config"), fifo.into_os_string()];
        assert_eq!(loopback_ports(&args, &[]).unwrap(), Vec::<u16>::new());

        // In a directory the guest writes, or reached through a link into one: its
        // ports are not the host user's choice.
        let share = dir.path().join("share");
        std::fs::create_dir(&share).unwrap();
        let planted = share.join("mcp.json");
        std::fs::write(&planted, r#"{"url":"http://127.0.0.1:5432/"}"#).unwrap();
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&planted, &link).unwrap();
        for path in [&planted, &link] {
            let args = [OsString::from("--mcp-config"), path.into()];
            let writable = [share.canonicalize().unwrap()];
            assert_eq!(loopback_ports(&args, &writable).unwrap(), Vec::<u16>::new());
            assert_eq!(loopback_ports(&args, &[]).unwrap(), [5432]);
        }
    }

    #[test]
    fn env_files_forward_values_and_named_host_variables() {
        let text = b"# comment\nexport A=1\nB=\"two words\"\r\nC='x=y'\nHOSTVAR\nMISSING\n\n";
        let host = |k: &str| (k == "HOSTVAR").then(|| "from host".into());
        assert_eq!(
            parse_env_file(text, host).unwrap(),
            [
                ("A".to_string(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "x=y".into()),
                ("HOSTVAR".into(), "from host".into()),
            ]
        );
        assert_eq!(parse_env_file(b"1BAD=x\n", |_| None).unwrap_err().0, 1);
        // Values are bytes (Latin-1 here), the file's or the host's; names are text.
        let latin1 = || OsStr::from_bytes(b"Jos\xe9").to_os_string();
        let host = |k: &str| (k == "HOSTVAR").then(latin1);
        assert_eq!(
            parse_env_file(b"NAME=\"Jos\xe9\"\nHOSTVAR\n", host).unwrap(),
            [("NAME".to_string(), latin1()), ("HOSTVAR".into(), latin1())]
        );
        assert_eq!(
            parse_env_file(b"A=1\nN\xc9=x\n", |_| None).unwrap_err().0,
            2
        );
        assert_eq!(parse_env_file(b"NUL=a\0b\n", |_| None).unwrap_err().0, 1);
    }

    #[test]
    fn the_home_is_seeded_read_only_and_refreshed() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        std::fs::create_dir_all(user.join(".claude/skills/s1")).unwrap();
        std::fs::write(user.join(".claude/CLAUDE.md"), "v1").unwrap();
        std::fs::write(user.join(".claude/skills/s1/SKILL.md"), "skill").unwrap();
        std::fs::write(user.join(".claude/.credentials.json"), "secret").unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        let home = agent_home_dir(&vm).join("claude");
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "v1"
        );
        assert!(home.join("skills/s1/SKILL.md").is_file());
        assert!(!home.join(".credentials.json").exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(home.join("CLAUDE.md"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o222, 0);
        std::fs::write(home.join("history.jsonl"), "kept").unwrap();
        std::fs::write(user.join(".claude/CLAUDE.md"), "v2").unwrap();
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "v2"
        );
        assert!(home.join("history.jsonl").exists());
    }

    /// What the agent in the VM made where the user has nothing (its memory in
    /// `CLAUDE.md`, its own subagents) outlives the next session's refresh; what a
    /// refresh copied goes once the user removes theirs. (Review: every refresh removed
    /// the agent's own entries.)
    #[test]
    fn the_agents_own_entries_are_kept_and_what_the_user_removed_goes() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        std::fs::create_dir_all(user.join(".claude/skills/s1")).unwrap();
        std::fs::write(user.join(".claude/skills/s1/SKILL.md"), "skill").unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        let home = agent_home_dir(&vm).join("claude");
        std::fs::write(home.join("CLAUDE.md"), "the agent's memory").unwrap();
        std::fs::create_dir(home.join("agents")).unwrap();
        std::fs::write(home.join("agents/reviewer.md"), "its subagent").unwrap();

        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "the agent's memory"
        );
        assert!(home.join("agents/reviewer.md").is_file());
        assert!(home.join("skills/s1/SKILL.md").is_file());

        std::fs::remove_dir_all(user.join(".claude/skills")).unwrap();
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert!(
            !home.join("skills").exists(),
            "the user's removal reaches the VM"
        );
        assert!(home.join("agents/reviewer.md").is_file());
        // The user's own, once there, takes the name (read-only, as every copy).
        std::fs::write(user.join(".claude/CLAUDE.md"), "the user's").unwrap();
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "the user's"
        );
    }

    /// A home seeded before the list of copies was kept: what looks like a copy (read
    /// only) goes once the user's is gone; what the agent wrote stays.
    #[test]
    fn a_home_without_the_list_takes_read_only_entries_for_copies() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        std::fs::create_dir_all(user.join(".claude/skills/s1")).unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        let home = agent_home_dir(&vm).join("claude");
        std::fs::remove_file(home.join(SEEDED_LIST)).unwrap();
        std::fs::create_dir(home.join("agents")).unwrap();
        std::fs::remove_dir_all(user.join(".claude/skills")).unwrap();
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert!(!home.join("skills").exists());
        assert!(home.join("agents").is_dir());
    }

    /// A `CLAUDE.md` linked into `~/.claude` (stow) is followed once, and no further:
    /// a guest that can write where it leads could have made that a link to any of the
    /// user's files, which the VM gets as the link, never as the file.
    #[test]
    fn a_linked_instruction_file_is_followed_once_and_no_further() {
        let dir = tempfile::tempdir().unwrap();
        let share = dir.path().join("dotfiles");
        std::fs::create_dir_all(&share).unwrap();
        std::fs::write(dir.path().join("id_ed25519"), "private key").unwrap();
        std::os::unix::fs::symlink(dir.path().join("id_ed25519"), share.join("CLAUDE.md")).unwrap();
        let user = dir.path().join("user");
        std::fs::create_dir_all(user.join(".claude")).unwrap();
        std::os::unix::fs::symlink(share.join("CLAUDE.md"), user.join(".claude/CLAUDE.md"))
            .unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        let copy = agent_home_dir(&vm).join("claude/CLAUDE.md");
        assert_eq!(
            std::fs::read_link(&copy).unwrap(),
            dir.path().join("id_ed25519")
        );
    }

    /// Stow's relative links to the user's dotfiles bring what they lead to, read-only:
    /// the guest has no such path, so the links alone left the VM's agents without the
    /// user's instructions and skills. A link with another link on its way (which a
    /// guest could have swapped in, in a directory it can write) is copied as the link.
    #[test]
    fn the_users_links_to_dotfiles_bring_what_they_lead_to() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        let dotfiles = user.join("dotfiles/claude");
        std::fs::create_dir_all(dotfiles.join("skills/review")).unwrap();
        std::fs::write(dotfiles.join("CLAUDE.md"), "be brief").unwrap();
        std::fs::write(dotfiles.join("skills/review/SKILL.md"), "review").unwrap();
        std::fs::create_dir_all(user.join(".claude")).unwrap();
        let link = |target: &str, name: &str| {
            std::os::unix::fs::symlink(target, user.join(".claude").join(name)).unwrap()
        };
        link("../dotfiles/claude/CLAUDE.md", "CLAUDE.md");
        link("../dotfiles/claude/skills", "skills");
        // A link on the way: the guest's, for all vmctl can tell.
        std::fs::create_dir_all(user.join("dotfiles/claude/agents")).unwrap();
        std::os::unix::fs::symlink("claude", user.join("dotfiles/way")).unwrap();
        link("../dotfiles/way/agents", "agents");
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        let home = agent_home_dir(&vm).join("claude");
        assert!(!std::fs::symlink_metadata(home.join("CLAUDE.md"))
            .unwrap()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "be brief"
        );
        let skill = home.join("skills/review/SKILL.md");
        assert!(!std::fs::symlink_metadata(home.join("skills"))
            .unwrap()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&skill).unwrap(), "review");
        let mode = std::fs::metadata(&skill).unwrap().permissions().mode();
        assert_eq!(mode & 0o222, 0, "{mode:o}");
        assert_eq!(
            std::fs::read_link(home.join("agents")).unwrap(),
            Path::new("../dotfiles/way/agents")
        );
        // The next refresh replaces the copies, as it does any.
        std::fs::write(dotfiles.join("CLAUDE.md"), "be briefer").unwrap();
        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "be briefer"
        );
    }

    /// Two sessions starting at once in one VM (Paseo starting two agents) both get
    /// their home: neither removes what the other is creating.
    #[test]
    fn sessions_starting_together_both_seed_the_home() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        for skill in 0..20 {
            let skill = user.join(format!(".claude/skills/s{skill}"));
            std::fs::create_dir_all(&skill).unwrap();
            std::fs::write(skill.join("SKILL.md"), "skill").unwrap();
        }
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::thread::scope(|scope| {
            let sessions: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        for _ in 0..20 {
                            seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude")))?;
                        }
                        Ok::<(), AgentError>(())
                    })
                })
                .collect();
            for session in sessions {
                session.join().unwrap().unwrap();
            }
        });
    }

    /// The guest replaced the VM's claude home with a symlink to the user's own
    /// ~/.claude (whose path it can read on its kernel command line): seeding must not
    /// remove or rewrite the user's files through it.
    #[test]
    fn a_guest_symlink_does_not_lead_the_seeding_into_the_users_home() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user");
        std::fs::create_dir_all(user.join(".claude/skills/s1")).unwrap();
        std::fs::write(user.join(".claude/CLAUDE.md"), "mine").unwrap();
        std::fs::write(user.join(".claude/skills/s1/SKILL.md"), "skill").unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(agent_home_dir(&vm)).unwrap();
        let home = agent_home_dir(&vm).join("claude");
        std::os::unix::fs::symlink(user.join(".claude"), &home).unwrap();

        seed_home(AgentCli::Claude, &vm, Some(&user.join(".claude"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(user.join(".claude/CLAUDE.md")).unwrap(),
            "mine"
        );
        assert!(user.join(".claude/skills/s1/SKILL.md").is_file());
        assert!(!std::fs::symlink_metadata(&home).unwrap().is_symlink());
        assert_eq!(
            std::fs::read_to_string(home.join("CLAUDE.md")).unwrap(),
            "mine"
        );
    }
}
