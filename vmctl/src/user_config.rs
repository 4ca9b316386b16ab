//! The user's vmctl config file (TOML): settings for every workspace, and per
//! workspace.
//!
//! ```toml
//! # every workspace
//! mounts = ["~/.gitconfig-dir:ro"]
//! relay_ports = [5432]          # host loopback ports every VM reaches at 127.0.0.1
//! relay_paseo = false           # Paseo's 6767 too? (default true; see relays_paseo)
//! idle_timeout_s = 30           # a VM stops this long after its last session
//! isolation = "workspace"       # or "directory": which VM a directory belongs to
//! cpus = 2                      # a new VM's vCPUs (default: all)
//! memory_percent = 10           # its memory, as a share of the host's RAM (0-100)...
//! memory_min_mib = 1024         # ...but at least this much
//! free_page_reporting = false   # a new VM keeps what its guest frees (default true)
//! drop_caches_after_idle_s = 600 # its guest drops its caches after this long without a
//!                                # command (default 300; 0: never; only with reporting)
//! [workspaces."/home/me/project"]
//! mounts = ["/srv/data:/data:ro"]
//! relay_ports = [8080]
//! ```
//!
//! It lives at `$VMCTL_CONFIG`, else `$XDG_CONFIG_HOME/vmctl/config.toml`, else
//! `~/.config/vmctl/config.toml`. It is deliberately never read from the workspace: a
//! repository must not be able to mount host directories into its own VM.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Names the config file, overriding the XDG location.
const CONFIG_ENV: &str = "VMCTL_CONFIG";

#[derive(Debug, thiserror::Error)]
pub enum UserConfigError {
    #[error("cannot read the vmctl config {}: {source}; fix it, or set {CONFIG_ENV} to another file", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("vmctl config {}{}: {message}; fix the file", .path.display(), .line.map(|l| format!(", line {l}")).unwrap_or_default())]
    Parse {
        path: PathBuf,
        line: Option<usize>,
        message: String,
    },
    #[error("vmctl config {}: workspace {key:?} is not an absolute path; write it as \"/path\" or \"~/path\"", .path.display())]
    RelativeWorkspace { path: PathBuf, key: String },
    #[error("vmctl config {}: idle_timeout_s = {value} is more than a year ({MAX_IDLE_TIMEOUT_S} s); write a smaller value (a VM started by `vmctl up` runs until `vmctl stop` anyway)", .path.display())]
    IdleTimeoutTooLong { path: PathBuf, value: u64 },
    #[error("vmctl config {}: {key} = {value} is out of range; write a value in {allowed}", .path.display())]
    OutOfRange {
        path: PathBuf,
        key: String,
        value: u32,
        allowed: &'static str,
    },
}

/// The most vCPUs a VM may have: what a CPU list can name (CPU_SETSIZE).
const MAX_CPUS: u32 = 1024;

/// The longest idle timeout the config may ask for: a year. (Far larger values would
/// overflow the daemon's clock arithmetic.)
const MAX_IDLE_TIMEOUT_S: u64 = 365 * 24 * 3600;

/// The parsed config file. Unknown keys are errors, so typos do not pass silently.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Shares (`HOST[:GUEST][:ro]`) of every workspace VM.
    #[serde(default)]
    pub mounts: Vec<String>,
    /// Host loopback ports relayed into every workspace VM.
    #[serde(default)]
    pub relay_ports: Vec<u16>,
    /// Whether Paseo's port is relayed into every workspace VM (default: yes).
    #[serde(default)]
    pub relay_paseo: Option<bool>,
    /// Seconds a VM keeps running after its last session ends (default 30).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// One VM per workspace (default) or per directory.
    #[serde(default)]
    pub isolation: Option<crate::workspace::Isolation>,
    /// vCPUs of a new VM (default: all of the host's).
    #[serde(default)]
    pub cpus: Option<u32>,
    /// Memory of a new VM as a percentage of the host's RAM (default 10).
    #[serde(default)]
    pub memory_percent: Option<u32>,
    /// The least memory of a new VM, in MiB (default 1024).
    #[serde(default)]
    pub memory_min_mib: Option<u64>,
    /// Whether a new VM's guest gives the memory it frees back to the host (default
    /// yes; `vmm::config::VmConfig::free_page_reporting`).
    #[serde(default)]
    pub free_page_reporting: Option<bool>,
    /// Seconds without a command after which a new VM's guest drops its caches, so
    /// that free page reporting gives that memory back too (default
    /// [`DEFAULT_DROP_CACHES_AFTER_IDLE_S`]; 0: never).
    #[serde(default)]
    pub drop_caches_after_idle_s: Option<u64>,
    /// Settings of one workspace, by its path (`~/` allowed).
    #[serde(default)]
    pub workspaces: BTreeMap<String, WorkspaceConfig>,
}

/// The one key the daemon reads, unknown ones ignored ([`UserConfig::load_idle_timeout`]).
#[derive(Debug, Default, Deserialize)]
struct IdleTimeoutOnly {
    #[serde(default)]
    idle_timeout_s: Option<u64>,
}

/// The config file at `path` parsed as `T`; `T`'s default where there is none.
fn parse_file<T: serde::de::DeserializeOwned + Default>(path: &Path) -> Result<T, UserConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::debug!("no user config at {}", path.display());
            return Ok(T::default());
        }
        Err(source) => {
            return Err(UserConfigError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    toml::from_str(&text).map_err(|e| UserConfigError::Parse {
        path: path.to_path_buf(),
        line: e.span().map(|span| line_of(&text, span.start)),
        // One line: toml's messages may run over several ("invalid array\nexpected `]`").
        message: e
            .message()
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .collect::<Vec<_>>()
            .join("; "),
    })
}

fn check_idle_timeout(path: &Path, idle_timeout_s: Option<u64>) -> Result<(), UserConfigError> {
    match idle_timeout_s.filter(|&s| s > MAX_IDLE_TIMEOUT_S) {
        Some(value) => Err(UserConfigError::IdleTimeoutTooLong {
            path: path.to_path_buf(),
            value,
        }),
        None => Ok(()),
    }
}

/// Settings of one workspace, added to the global ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceConfig {
    #[serde(default)]
    pub mounts: Vec<String>,
    #[serde(default)]
    pub relay_ports: Vec<u16>,
    #[serde(default)]
    pub relay_paseo: Option<bool>,
    #[serde(default)]
    pub cpus: Option<u32>,
    #[serde(default)]
    pub memory_percent: Option<u32>,
    #[serde(default)]
    pub memory_min_mib: Option<u64>,
    #[serde(default)]
    pub free_page_reporting: Option<bool>,
    #[serde(default)]
    pub drop_caches_after_idle_s: Option<u64>,
}

/// How long a guest goes without a command before it drops its caches, by default.
pub const DEFAULT_DROP_CACHES_AFTER_IDLE_S: u64 = 300;

/// What a new VM gets (unset: the defaults); a workspace's settings override the
/// global ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpus: Option<u32>,
    pub memory_percent: Option<u32>,
    pub memory_min_mib: Option<u64>,
    pub free_page_reporting: Option<bool>,
    pub drop_caches_after_idle_s: Option<u64>,
}

impl Resources {
    /// Whether the VM's guest gives back the memory it frees (its balloon): unless the
    /// config says no.
    pub fn reports_free_pages(&self) -> bool {
        self.free_page_reporting.unwrap_or(true)
    }
}

/// `HOME`, against which the sections' `~/` paths are read.
fn home_from_env() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

impl UserConfig {
    /// Reads the user's config file; a missing file is an empty config.
    pub fn load() -> Result<UserConfig, UserConfigError> {
        match config_path() {
            Some(path) => Self::load_from(&path),
            None => {
                tracing::debug!("no HOME and no {CONFIG_ENV}: no user config");
                Ok(UserConfig::default())
            }
        }
    }

    fn load_from(path: &Path) -> Result<UserConfig, UserConfigError> {
        let config: UserConfig = parse_file(path)?;
        if let Some(key) = config
            .workspaces
            .keys()
            .find(|key| !key.starts_with('/') && *key != "~" && !key.starts_with("~/"))
        {
            return Err(UserConfigError::RelativeWorkspace {
                path: path.to_path_buf(),
                key: key.clone(),
            });
        }
        check_idle_timeout(path, config.idle_timeout_s)?;
        config.check_ranges(path)?;
        Ok(config)
    }

    /// The idle timeout alone, as the daemon reads it: keys it does not know are not its
    /// business. A daemon outlives upgrades (an older one still runs when the user adds
    /// a key a newer vmctl knows), and must not drop the user's timeout for them; the
    /// commands still refuse unknown keys, so typos are caught.
    pub fn load_idle_timeout() -> Result<Option<u64>, UserConfigError> {
        match config_path() {
            Some(path) => Self::idle_timeout_in(&path),
            None => Ok(None),
        }
    }

    fn idle_timeout_in(path: &Path) -> Result<Option<u64>, UserConfigError> {
        let config: IdleTimeoutOnly = parse_file(path)?;
        check_idle_timeout(path, config.idle_timeout_s)?;
        Ok(config.idle_timeout_s)
    }

    /// Refuses sizes no VM can have (`cpus = 0`, `memory_percent = 500`) rather than
    /// quietly starting a VM of another size than the file says.
    fn check_ranges(&self, path: &Path) -> Result<(), UserConfigError> {
        let sections = std::iter::once((String::new(), self.cpus, self.memory_percent)).chain(
            self.workspaces.iter().map(|(key, settings)| {
                (
                    format!("[workspaces.{key:?}] "),
                    settings.cpus,
                    settings.memory_percent,
                )
            }),
        );
        for (section, cpus, memory_percent) in sections {
            let checks = [
                ("cpus", cpus, 1..=MAX_CPUS, "1..=1024"),
                // 0 leaves memory_min_mib alone to size the VM.
                ("memory_percent", memory_percent, 0..=100, "0..=100"),
            ];
            for (name, value, range, allowed) in checks {
                if let Some(value) = value.filter(|value| !range.contains(value)) {
                    return Err(UserConfigError::OutOfRange {
                        path: path.to_path_buf(),
                        key: format!("{section}{name}"),
                        value,
                        allowed,
                    });
                }
            }
        }
        Ok(())
    }

    /// The mounts of `workspace`: the global ones, then the workspace's own.
    pub fn mounts_for(&self, workspace: &Path) -> Vec<String> {
        let home = home_from_env();
        self.mounts_for_with_home(workspace, home.as_deref())
    }

    fn mounts_for_with_home(&self, workspace: &Path, home: Option<&Path>) -> Vec<String> {
        let mut mounts = self.mounts.clone();
        for settings in self.settings_of(workspace, home) {
            mounts.extend(settings.mounts.iter().cloned());
        }
        mounts
    }

    /// The resources of a new VM of `workspace`: the workspace's settings, else the
    /// global ones.
    pub fn resources_for(&self, workspace: &Path) -> Resources {
        let home = home_from_env();
        let global = Resources {
            cpus: self.cpus,
            memory_percent: self.memory_percent,
            memory_min_mib: self.memory_min_mib,
            free_page_reporting: self.free_page_reporting,
            drop_caches_after_idle_s: self.drop_caches_after_idle_s,
        };
        self.settings_of(workspace, home.as_deref())
            .fold(global, |global, settings| Resources {
                cpus: settings.cpus.or(global.cpus),
                memory_percent: settings.memory_percent.or(global.memory_percent),
                memory_min_mib: settings.memory_min_mib.or(global.memory_min_mib),
                free_page_reporting: settings.free_page_reporting.or(global.free_page_reporting),
                drop_caches_after_idle_s: settings
                    .drop_caches_after_idle_s
                    .or(global.drop_caches_after_idle_s),
            })
    }

    /// The relay ports of `workspace`: the global ones, then the workspace's own.
    pub fn relay_ports_for(&self, workspace: &Path) -> Vec<u16> {
        let home = home_from_env();
        self.relay_ports_for_with_home(workspace, home.as_deref())
    }

    fn relay_ports_for_with_home(&self, workspace: &Path, home: Option<&Path>) -> Vec<u16> {
        let mut ports = self.relay_ports.clone();
        for settings in self.settings_of(workspace, home) {
            ports.extend(settings.relay_ports.iter().copied());
        }
        ports
    }

    /// Whether Paseo's port is relayed into the VM of `workspace`: yes, unless the
    /// workspace's settings or, failing those, the global ones say no. Paseo's daemon
    /// takes any local client, so a guest that reaches it can start agents outside any
    /// VM; the MCP servers an agent session names are relayed anyway.
    pub fn relays_paseo(&self, workspace: &Path) -> bool {
        let home = home_from_env();
        self.relays_paseo_with_home(workspace, home.as_deref())
    }

    fn relays_paseo_with_home(&self, workspace: &Path, home: Option<&Path>) -> bool {
        self.settings_of(workspace, home)
            .fold(self.relay_paseo, |global, settings| {
                settings.relay_paseo.or(global)
            })
            .unwrap_or(true)
    }

    /// The sections that apply to `workspace`, weakest first: for a git worktree, its
    /// main checkout's (a project's settings hold for the worktrees Paseo makes of
    /// it), then its own.
    fn settings_of<'a>(
        &'a self,
        workspace: &Path,
        home: Option<&'a Path>,
    ) -> impl Iterator<Item = &'a WorkspaceConfig> + 'a {
        let workspace = canonical_or_given(workspace);
        let main_checkout = match crate::worktree::common_git_dir(&workspace) {
            crate::worktree::GitDir::Common(git_dir) if git_dir.ends_with(".git") => {
                git_dir.parent().map(Path::to_path_buf)
            }
            _ => None,
        };
        let section = move |path: PathBuf| {
            self.workspaces.iter().filter_map(move |(key, settings)| {
                let matches = expand_home(key, home)
                    .map(|key| canonical_or_given(&key) == path)
                    .unwrap_or(false);
                matches.then_some(settings)
            })
        };
        main_checkout
            .into_iter()
            .flat_map(section)
            .chain(section(workspace))
    }
}

/// Makes a relative `VMCTL_CONFIG` absolute (from the current directory), for this
/// process and the daemon and supervisors it starts, which run from elsewhere: its
/// directory is the one kept out of the VM's shares and holding the egress files,
/// and an empty one (`VMCTL_CONFIG=test.toml`) would keep every share out. Call before
/// any thread starts.
pub fn make_config_path_absolute() {
    let given = std::env::var_os(CONFIG_ENV).unwrap_or_default();
    if given.is_empty() || Path::new(&given).is_absolute() {
        return;
    }
    if let Some(absolute) = config_path() {
        std::env::set_var(CONFIG_ENV, absolute);
    }
}

/// Where the user's config file is; None without HOME (and no override).
pub fn config_path() -> Option<PathBuf> {
    config_path_from(
        std::env::var_os(CONFIG_ENV),
        std::env::var_os("XDG_CONFIG_HOME"),
        std::env::var_os("HOME"),
    )
}

fn config_path_from(
    explicit: Option<OsString>,
    xdg_config_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(explicit) = explicit.filter(|p| !p.is_empty()) {
        let explicit = PathBuf::from(explicit);
        return Some(std::path::absolute(&explicit).unwrap_or(explicit));
    }
    // The XDG spec says to ignore a relative XDG_CONFIG_HOME.
    let config_home = xdg_config_home
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            home.filter(|h| !h.is_empty())
                .map(|h| PathBuf::from(h).join(".config"))
        })?;
    Some(config_home.join("vmctl/config.toml"))
}

/// `~` and `~/...` from `home`; None when that is needed but unknown.
fn expand_home(path: &str, home: Option<&Path>) -> Option<PathBuf> {
    if path == "~" {
        return home.map(Path::to_path_buf);
    }
    match path.strip_prefix("~/") {
        Some(rest) => home.map(|home| home.join(rest)),
        None => Some(PathBuf::from(path)),
    }
}

/// Canonical when it exists, so that symlinked and `..` spellings of a workspace
/// match; as given otherwise.
fn canonical_or_given(path: &Path) -> PathBuf {
    path.canonicalize().unwrap_or_else(|_| path.to_path_buf())
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_config(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("config.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// An older daemon still running when the user adds a key a newer vmctl knows
    /// must keep their timeout (it fell back to 30 s); the commands still refuse it.
    #[test]
    fn the_daemon_reads_the_idle_timeout_past_keys_it_does_not_know() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(
            dir.path(),
            "idle_timeout_s = 3600\nkey_of_a_newer_vmctl = 1\n",
        );
        assert_eq!(UserConfig::idle_timeout_in(&path).unwrap(), Some(3600));
        assert!(
            UserConfig::load_from(&path).is_err(),
            "the commands take typos"
        );
        let too_long = write_config(dir.path(), &format!("idle_timeout_s = {}\n", u64::MAX));
        assert!(UserConfig::idle_timeout_in(&too_long).is_err());
        assert_eq!(
            UserConfig::idle_timeout_in(&dir.path().join("none")).unwrap(),
            None
        );
    }

    #[test]
    fn a_missing_file_is_an_empty_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = UserConfig::load_from(&dir.path().join("absent.toml")).unwrap();
        assert_eq!(config, UserConfig::default());
        assert!(config.mounts_for(dir.path()).is_empty());
    }

    #[test]
    fn a_worktree_has_its_projects_settings_then_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let project = root.join("project");
        std::fs::create_dir_all(&project).unwrap();
        let git = |args: &[&str]| {
            let status = std::process::Command::new("git")
                .args(["-c", "user.email=t@t", "-c", "user.name=t"])
                .args(args)
                .current_dir(&project)
                .status()
                .unwrap();
            assert!(status.success(), "git {args:?}");
        };
        git(&["init", "-q"]);
        git(&["commit", "-q", "--allow-empty", "-m", "one"]);
        git(&["worktree", "add", "-q", "../feature"]);
        let worktree = root.join("feature");
        let text = format!(
            "mounts = [\"/global\"]\n\
             [workspaces.\"{project}\"]\nmounts = [\"/project\"]\ncpus = 2\nmemory_percent = 20\n\
             [workspaces.\"{worktree}\"]\nmounts = [\"/feature\"]\ncpus = 4\n",
            project = project.display(),
            worktree = worktree.display()
        );
        let config = UserConfig::load_from(&write_config(&root, &text)).unwrap();
        assert_eq!(
            config.mounts_for_with_home(&worktree, None),
            ["/global", "/project", "/feature"]
        );
        assert_eq!(
            config.mounts_for_with_home(&project, None),
            ["/global", "/project"]
        );
        let resources = config.resources_for(&worktree);
        assert_eq!(resources.cpus, Some(4), "its own section wins");
        assert_eq!(resources.memory_percent, Some(20), "the project's fills in");
    }

    #[test]
    fn global_mounts_come_before_the_workspace_ones() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        let other = dir.path().join("other");
        std::fs::create_dir_all(&project).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let text = format!(
            r#"
# every workspace
mounts = ["~/.gitconfig-dir:ro"]

[workspaces."{project}/../project"]
mounts = ["/srv/data:/data:ro"]

[workspaces."~/other"]
mounts = ["/srv/other"]
"#,
            project = project.display()
        );
        let config = UserConfig::load_from(&write_config(dir.path(), &text)).unwrap();
        assert_eq!(
            config.mounts_for_with_home(&project, Some(dir.path())),
            ["~/.gitconfig-dir:ro", "/srv/data:/data:ro"]
        );
        assert_eq!(
            config.mounts_for_with_home(&other, Some(dir.path())),
            ["~/.gitconfig-dir:ro", "/srv/other"]
        );
        assert_eq!(
            config.mounts_for_with_home(&other, None),
            ["~/.gitconfig-dir:ro"]
        );
        assert_eq!(
            config.mounts_for_with_home(dir.path(), Some(dir.path())),
            ["~/.gitconfig-dir:ro"]
        );
    }

    #[test]
    fn paseo_is_relayed_unless_the_workspace_or_else_the_global_settings_say_no() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir(&project).unwrap();
        let relays = |text: &str, workspace: &Path| {
            let config: UserConfig = toml::from_str(text).unwrap();
            config.relays_paseo_with_home(workspace, Some(dir.path()))
        };
        assert!(relays("", &project));
        assert!(!relays("relay_paseo = false\n", &project));
        let only_project = "[workspaces.\"~/project\"]\nrelay_paseo = false\n";
        assert!(!relays(only_project, &project));
        assert!(relays(only_project, dir.path()));
        let all_but_project =
            "relay_paseo = false\n[workspaces.\"~/project\"]\nrelay_paseo = true\n";
        assert!(relays(all_but_project, &project));
        assert!(!relays(all_but_project, dir.path()));
    }

    #[test]
    fn relay_ports_are_global_then_per_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        let text = "relay_ports = [8080]\n[workspaces.\"~/project\"]\nrelay_ports = [9000]\n";
        let config = UserConfig::load_from(&write_config(dir.path(), text)).unwrap();
        assert_eq!(
            config.relay_ports_for_with_home(&project, Some(dir.path())),
            [8080, 9000]
        );
        assert_eq!(
            config.relay_ports_for_with_home(dir.path(), Some(dir.path())),
            [8080]
        );
    }

    #[test]
    fn a_workspace_overrides_the_global_resources_it_sets() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        let text = format!(
            "cpus = 4\nmemory_percent = 20\nidle_timeout_s = 5\nisolation = \"directory\"\n\
             [workspaces.\"{}\"]\nmemory_percent = 50\n",
            project.display()
        );
        let config = UserConfig::load_from(&write_config(dir.path(), &text)).unwrap();
        assert_eq!(config.idle_timeout_s, Some(5));
        // "Never" written as a huge number is refused, not left to overflow the daemon.
        let never = format!("idle_timeout_s = {}\n", i64::MAX);
        let err = UserConfig::load_from(&write_config(dir.path(), &never)).unwrap_err();
        assert!(err.to_string().contains("more than a year"), "{err}");
        assert_eq!(
            config.isolation,
            Some(crate::workspace::Isolation::Directory)
        );
        let expect = |cpus, memory_percent| Resources {
            cpus,
            memory_percent,
            memory_min_mib: None,
            free_page_reporting: None,
            drop_caches_after_idle_s: None,
        };
        assert_eq!(config.resources_for(&project), expect(Some(4), Some(50)));
        assert_eq!(config.resources_for(dir.path()), expect(Some(4), Some(20)));
    }

    /// What a new VM of `workspace` gets under the config `text`, written in `dir`.
    fn resources_in(dir: &Path, text: &str, workspace: &Path) -> Resources {
        let config = UserConfig::load_from(&write_config(dir, text)).unwrap();
        config.resources_for(workspace)
    }

    #[test]
    fn the_idle_time_before_the_caches_go_is_the_workspaces_else_the_global_one() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        let idle = |text: &str, workspace: &Path| {
            resources_in(dir.path(), text, workspace).drop_caches_after_idle_s
        };
        assert_eq!(idle("", &project), None);
        let text = format!(
            "drop_caches_after_idle_s = 60
[workspaces.\"{}\"]
drop_caches_after_idle_s = 0
",
            project.display()
        );
        assert_eq!(idle(&text, &project), Some(0));
        assert_eq!(idle(&text, dir.path()), Some(60));
    }

    #[test]
    fn free_page_reporting_is_on_unless_the_workspace_or_else_the_global_settings_say_no() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        let reporting = |text: &str, workspace: &Path| {
            resources_in(dir.path(), text, workspace).free_page_reporting
        };
        // Unset: the record gets the default, true.
        assert_eq!(reporting("", &project), None);
        assert!(resources_in(dir.path(), "", &project).reports_free_pages());
        let all_but_project = format!(
            "free_page_reporting = false\n[workspaces.\"{}\"]\nfree_page_reporting = true\n",
            project.display()
        );
        assert_eq!(reporting(&all_but_project, &project), Some(true));
        assert_eq!(reporting(&all_but_project, dir.path()), Some(false));
        let only_project = format!(
            "[workspaces.\"{}\"]\nfree_page_reporting = false\n",
            project.display()
        );
        assert_eq!(reporting(&only_project, &project), Some(false));
        assert!(!resources_in(dir.path(), &only_project, &project).reports_free_pages());
        assert_eq!(reporting(&only_project, dir.path()), None);
    }

    #[test]
    fn unknown_keys_are_reported_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), "mountz = []\n");
        let error = UserConfig::load_from(&path).unwrap_err().to_string();
        assert!(error.contains("mountz"), "{error}");
        assert!(error.contains(&path.display().to_string()), "{error}");
        let path = write_config(dir.path(), "[workspaces.\"/w\"]\nmount = []\n");
        let error = UserConfig::load_from(&path).unwrap_err().to_string();
        assert!(error.contains("`mount`"), "{error}");
        assert!(error.contains("line 2"), "{error}");
    }

    #[test]
    fn bad_toml_is_reported_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), "# fine\nmounts = [\"/a\"]\nmounts = = 3\n");
        let error = UserConfig::load_from(&path).unwrap_err().to_string();
        assert!(error.contains("line 3"), "{error}");
        assert!(error.contains(&path.display().to_string()), "{error}");
    }

    #[test]
    fn sizes_no_vm_can_have_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let refused = [
            ("cpus = 0\n", "cpus = 0"),
            ("cpus = 1025\n", "cpus = 1025"),
            ("memory_percent = 500\n", "memory_percent = 500"),
            (
                "[workspaces.\"/w\"]\nmemory_percent = 101\n",
                "[workspaces.\"/w\"] memory_percent = 101",
            ),
        ];
        for (text, named) in refused {
            let path = write_config(dir.path(), text);
            let error = UserConfig::load_from(&path).unwrap_err().to_string();
            assert!(error.contains(named), "{text:?}: {error}");
            assert!(error.contains(&path.display().to_string()), "{error}");
        }
        let bounds = "cpus = 1024\nmemory_percent = 100\n[workspaces.\"/w\"]\ncpus = 1\nmemory_percent = 0\n";
        UserConfig::load_from(&write_config(dir.path(), bounds)).unwrap();
    }

    #[test]
    fn relative_workspace_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), "[workspaces.project]\nmounts = []\n");
        let error = UserConfig::load_from(&path).unwrap_err().to_string();
        assert!(error.contains("\"project\""), "{error}");
    }

    #[test]
    fn the_file_is_found_by_override_then_xdg_then_home() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            config_path_from(os("/etc/vm.toml"), os("/x"), os("/h")),
            Some("/etc/vm.toml".into())
        );
        assert_eq!(
            config_path_from(None, os("/x"), os("/h")),
            Some("/x/vmctl/config.toml".into())
        );
        assert_eq!(
            config_path_from(os(""), os("relative"), os("/h")),
            Some("/h/.config/vmctl/config.toml".into())
        );
        assert_eq!(config_path_from(None, None, None), None);
        // A relative override is the current directory's: its parent must never be
        // the empty path, which every share would be "inside".
        let relative = config_path_from(os("test.toml"), None, os("/h")).unwrap();
        assert_eq!(relative, std::env::current_dir().unwrap().join("test.toml"));
    }

    #[test]
    fn lines_are_counted_from_one() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 99), 3);
    }
}
