//! `vmctl paseo install|uninstall`: make Paseo run its Claude Code and Codex agents in
//! vmctl VMs.
//!
//! Paseo (<https://github.com/getpaseo/paseo>) reads custom providers from
//! `agents.providers` in `$PASEO_HOME/config.json` (default `~/.paseo/config.json`).
//! Its reference (`docs/custom-providers.md` in that repository) says a custom entry
//! needs `extends` (a built-in provider id such as `claude` or `codex`) and a `label`
//! (its name in the UI), and that `command` is a `string[]`: the binary, then its
//! arguments, replacing the provider's default command. `install` adds
//!
//! ```json
//! { "agents": { "providers": {
//!     "claude-vm": { "extends": "claude", "label": "Claude (VM)",
//!                    "command": ["/abs/path/vmctl", "agent", "claude"] },
//!     "codex-vm":  { "extends": "codex", "label": "Codex (VM)",
//!                    "command": ["/abs/path/vmctl", "agent", "codex"] } } } }
//! ```
//!
//! and keeps everything else in the file: other keys keep their order, values and
//! indentation (the file is re-serialised with the indentation it had, so a file
//! Paseo wrote comes back byte-identical apart from our entries). Before any change
//! the file is copied to `config.json.bak-<unix seconds>` beside it (same permissions:
//! the file may hold API keys), and the new text replaces it atomically (temporary
//! file in the same directory, then rename; permissions and owner kept, a symlinked
//! config is written through). A config that is not JSON, or whose top level,
//! `agents` or `agents.providers` is not an object, is reported and never written.
//!
//! `uninstall` removes `claude-vm` and `codex-vm` when they are still exactly what
//! `install` writes (for any absolute vmctl path: the binary may have moved); an entry
//! changed by hand is left alone, and said so. It then drops `agents.providers` if
//! that became empty, and `agents` if that became empty too, so install + uninstall
//! gives back the original file (except for an explicitly empty `"providers": {}`,
//! which is removed as well).

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// `vmctl paseo ...`
#[derive(Debug, clap::Subcommand)]
pub enum PaseoCommand {
    /// Add the claude-vm and codex-vm providers to Paseo's config, so Paseo runs
    /// Claude Code and Codex agents inside vmctl VMs.
    ///
    /// The providers extend Paseo's claude and codex providers and launch
    /// `vmctl agent claude` / `vmctl agent codex` by this vmctl's absolute path. The
    /// rest of the config is kept; the previous file is backed up beside it as
    /// config.json.bak-N, N the time in Unix seconds. Running it again changes nothing. Restart Paseo
    /// afterwards and pick "Claude (VM)" or "Codex (VM)" as an agent's provider.
    Install {
        /// Paseo's config file [default: $PASEO_HOME/config.json, else
        /// ~/.paseo/config.json]
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
    },
    /// Remove the providers `vmctl paseo install` added from Paseo's config.
    ///
    /// An entry that was changed by hand since is left alone (and reported). The
    /// previous file is backed up beside it as config.json.bak-N, N the time in Unix
    /// seconds.
    Uninstall {
        /// Paseo's config file [default: $PASEO_HOME/config.json, else
        /// ~/.paseo/config.json]
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum PaseoError {
    #[error("cannot tell where Paseo's config is: neither PASEO_HOME nor HOME is set; pass --config PATH")]
    NoConfigPath,
    #[error("cannot find vmctl's own executable: {0}")]
    OwnExecutable(#[source] io::Error),
    #[error("vmctl's path {} {problem}; Paseo needs an absolute path it can run", .path.display())]
    VmctlPath {
        path: PathBuf,
        problem: &'static str,
    },
    #[error("cannot read Paseo's config {}: {source}; check the path and its permissions (or pass --config)", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("Paseo's config {} is not valid JSON: {reason}; fix or move the file and run again (vmctl left it untouched)", .path.display())]
    Malformed { path: PathBuf, reason: String },
    #[error("Paseo's config {}: {what} is {found}, not a JSON object; fix the file and run again (vmctl left it untouched)", .path.display())]
    Shape {
        path: PathBuf,
        what: &'static str,
        found: &'static str,
    },
    #[error("cannot back up Paseo's config to {}: {source}; nothing was changed", .path.display())]
    Backup { path: PathBuf, source: io::Error },
    #[error("cannot write Paseo's config {}: {source}; the file was left as it was", .path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("Paseo's config {} changed while vmctl was editing it (is Paseo saving its settings?); nothing was changed, run the command again", .path.display())]
    ChangedMeanwhile { path: PathBuf },
}

/// One provider `install` adds.
struct Provider {
    id: &'static str,
    /// The built-in Paseo provider it extends, also the argument of `vmctl agent`.
    extends: &'static str,
    label: &'static str,
}

const PROVIDERS: [Provider; 2] = [
    Provider {
        id: "claude-vm",
        extends: "claude",
        label: "Claude (VM)",
    },
    Provider {
        id: "codex-vm",
        extends: "codex",
        label: "Codex (VM)",
    },
];

fn provider(id: &str) -> &'static Provider {
    PROVIDERS
        .iter()
        .find(|p| p.id == id)
        .expect("ids come from PROVIDERS")
}

impl Provider {
    /// The entry `install` writes for the vmctl binary at `vmctl`.
    fn entry(&self, vmctl: &str) -> Json {
        let command = [vmctl, "agent", self.extends]
            .iter()
            .map(|s| Json::String((*s).to_owned()))
            .collect();
        Json::Object(Object(vec![
            ("extends".into(), Json::String(self.extends.into())),
            ("label".into(), Json::String(self.label.into())),
            ("command".into(), Json::Array(command)),
        ]))
    }

    /// The vmctl binary of `entry` if the entry is exactly what `install` writes
    /// (with whatever absolute path). The binary's name is not checked: `install`
    /// records the resolved executable, which need not be called `vmctl`.
    fn ours<'a>(&self, entry: &'a Json) -> Option<&'a str> {
        let Some(Json::Array(command)) = entry.as_object()?.get("command") else {
            return None;
        };
        let Some(Json::String(binary)) = command.first() else {
            return None;
        };
        (Path::new(binary).is_absolute() && entry.same(&self.entry(binary))).then_some(binary)
    }
}

/// What `install` did to one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallChange {
    Added,
    /// It was already exactly our entry.
    Unchanged,
    /// An entry of that name was replaced; `previous_vmctl` is the binary it ran if it
    /// was one `install` wrote (for another vmctl path), `None` if it was something else.
    Replaced {
        previous_vmctl: Option<String>,
    },
}

/// The result of [`install`]; its `Display` tells the user what changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallOutcome {
    pub config: PathBuf,
    pub vmctl: PathBuf,
    /// The file did not exist and was created.
    pub created: bool,
    /// Where the previous file was copied, if it was changed.
    pub backup: Option<PathBuf>,
    /// Each provider id (`claude-vm`, `codex-vm`) and what happened to it.
    pub providers: Vec<(&'static str, InstallChange)>,
}

impl InstallOutcome {
    /// Whether the file was written.
    pub fn changed(&self) -> bool {
        self.providers
            .iter()
            .any(|(_, c)| *c != InstallChange::Unchanged)
    }
}

impl fmt::Display for InstallOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = self.config.display();
        if !self.changed() {
            return write!(
                f,
                "Paseo providers claude-vm and codex-vm are already installed in {config}; nothing changed."
            );
        }
        if self.created {
            writeln!(f, "Created {config}.")?;
        }
        for (id, change) in &self.providers {
            let p = provider(id);
            let runs = format!("{} agent {}", self.vmctl.display(), p.extends);
            match change {
                InstallChange::Added => writeln!(
                    f,
                    "Added Paseo provider {id} (\"{}\"): runs {runs}.",
                    p.label
                )?,
                InstallChange::Unchanged => {
                    writeln!(f, "Paseo provider {id} was already up to date.")?
                }
                InstallChange::Replaced {
                    previous_vmctl: Some(old),
                } => writeln!(
                    f,
                    "Updated Paseo provider {id} (\"{}\"): it ran {old}, now runs {runs}.",
                    p.label
                )?,
                InstallChange::Replaced {
                    previous_vmctl: None,
                } => writeln!(
                    f,
                    "Replaced Paseo provider {id}, which was not the entry vmctl writes \
                     (the old entry is in the backup): now runs {runs}."
                )?,
            }
        }
        writeln!(f, "Updated {config}.")?;
        if let Some(backup) = &self.backup {
            writeln!(f, "The previous config is saved as {}.", backup.display())?;
        }
        write!(
            f,
            "Restart Paseo so it loads them, then pick \"Claude (VM)\" or \"Codex (VM)\" \
             as the provider of a new agent."
        )
    }
}

/// What `uninstall` did to one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UninstallChange {
    Removed,
    /// There was no entry of that name.
    Absent,
    /// The entry was changed after `install`, so it was left in place.
    KeptModified,
}

/// The result of [`uninstall`]; its `Display` tells the user what changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UninstallOutcome {
    pub config: PathBuf,
    /// The config file does not exist (nothing to do).
    pub missing_file: bool,
    /// Where the previous file was copied, if it was changed.
    pub backup: Option<PathBuf>,
    /// Each provider id (`claude-vm`, `codex-vm`) and what happened to it.
    pub providers: Vec<(&'static str, UninstallChange)>,
}

impl UninstallOutcome {
    /// Whether the file was written.
    pub fn changed(&self) -> bool {
        self.providers
            .iter()
            .any(|(_, c)| *c == UninstallChange::Removed)
    }
}

impl fmt::Display for UninstallOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = self.config.display();
        if self.missing_file {
            return write!(f, "{config} does not exist; there is nothing to uninstall.");
        }
        let mut lines = Vec::new();
        for (id, change) in &self.providers {
            match change {
                UninstallChange::Removed => lines.push(format!("Removed Paseo provider {id}.")),
                UninstallChange::KeptModified => lines.push(format!(
                    "Left Paseo provider {id} in place: it was changed after `vmctl paseo install`; \
                     remove it from {config} by hand if you no longer want it."
                )),
                UninstallChange::Absent => {}
            }
        }
        if lines.is_empty() {
            return write!(
                f,
                "Paseo providers claude-vm and codex-vm are not in {config}; nothing changed."
            );
        }
        if self.changed() {
            lines.push(format!("Updated {config}."));
            if let Some(backup) = &self.backup {
                lines.push(format!(
                    "The previous config is saved as {}.",
                    backup.display()
                ));
            }
            lines.push("Restart Paseo so it drops them.".into());
        }
        write!(f, "{}", lines.join("\n"))
    }
}

/// Paseo's config file: `$PASEO_HOME/config.json` if PASEO_HOME is set and not empty,
/// else `$HOME/.paseo/config.json`; `None` without either.
pub fn config_path() -> Option<PathBuf> {
    config_path_from(std::env::var_os("PASEO_HOME"), std::env::var_os("HOME"))
}

/// [`config_path`] for the given values of PASEO_HOME and HOME.
fn config_path_from(paseo_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    if let Some(dir) = paseo_home.filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    let home = home.filter(|h| !h.is_empty())?;
    Some(PathBuf::from(home).join(".paseo").join("config.json"))
}

/// Runs `vmctl paseo ...`: prints what changed on stderr; returns the exit code.
pub fn run(command: PaseoCommand) -> Result<u8, PaseoError> {
    match command {
        PaseoCommand::Install { config } => {
            let config = config
                .or_else(config_path)
                .ok_or(PaseoError::NoConfigPath)?;
            let vmctl = own_executable()?;
            vmm::to_stderr!("{}", install(&config, &vmctl)?);
        }
        PaseoCommand::Uninstall { config } => {
            let config = config
                .or_else(config_path)
                .ok_or(PaseoError::NoConfigPath)?;
            vmm::to_stderr!("{}", uninstall(&config)?);
        }
    }
    Ok(0)
}

/// This vmctl binary, symlinks resolved.
fn own_executable() -> Result<PathBuf, PaseoError> {
    let exe = std::env::current_exe().map_err(PaseoError::OwnExecutable)?;
    Ok(fs::canonicalize(&exe).unwrap_or(exe))
}

/// Adds (or updates) the `claude-vm` and `codex-vm` providers in the Paseo config at
/// `config`, running the vmctl binary at `vmctl` (an absolute path).
pub fn install(config: &Path, vmctl: &Path) -> Result<InstallOutcome, PaseoError> {
    let vmctl_arg = match vmctl.to_str() {
        _ if !vmctl.is_absolute() => {
            return Err(PaseoError::VmctlPath {
                path: vmctl.into(),
                problem: "is not absolute",
            })
        }
        Some(s) => s,
        None => {
            return Err(PaseoError::VmctlPath {
                path: vmctl.into(),
                problem: "is not valid UTF-8 (JSON cannot hold it)",
            })
        }
    };
    let original = read_config(config)?;
    let mut doc = parse(config, original.as_deref())?;
    let providers = providers_mut(config, &mut doc, true)?.expect("created when missing");
    let mut changes = Vec::new();
    for p in &PROVIDERS {
        let wanted = p.entry(vmctl_arg);
        let change = match providers.get(p.id) {
            None => InstallChange::Added,
            Some(old) if old.same(&wanted) => InstallChange::Unchanged,
            Some(old) => InstallChange::Replaced {
                previous_vmctl: p.ours(old).map(str::to_owned),
            },
        };
        if change != InstallChange::Unchanged {
            providers.insert(p.id, wanted);
        }
        changes.push((p.id, change));
    }
    let mut outcome = InstallOutcome {
        config: config.to_path_buf(),
        vmctl: vmctl.to_path_buf(),
        created: original.is_none(),
        backup: None,
        providers: changes,
    };
    if outcome.changed() {
        outcome.backup = write_config(config, original.as_deref(), &doc)?;
    } else {
        outcome.created = false;
    }
    Ok(outcome)
}

/// Removes the providers [`install`] added from the Paseo config at `config`, unless
/// they were changed since.
pub fn uninstall(config: &Path) -> Result<UninstallOutcome, PaseoError> {
    let mut outcome = UninstallOutcome {
        config: config.to_path_buf(),
        missing_file: false,
        backup: None,
        providers: PROVIDERS
            .iter()
            .map(|p| (p.id, UninstallChange::Absent))
            .collect(),
    };
    let Some(original) = read_config(config)? else {
        outcome.missing_file = true;
        return Ok(outcome);
    };
    let mut doc = parse(config, Some(&original))?;
    let Some(providers) = providers_mut(config, &mut doc, false)? else {
        return Ok(outcome);
    };
    for (p, (_, change)) in PROVIDERS.iter().zip(&mut outcome.providers) {
        *change = match providers.get(p.id) {
            None => UninstallChange::Absent,
            Some(entry) if p.ours(entry).is_some() => {
                providers.remove(p.id);
                UninstallChange::Removed
            }
            Some(_) => UninstallChange::KeptModified,
        };
    }
    if !outcome.changed() {
        return Ok(outcome);
    }
    if providers.0.is_empty() {
        let Some(Json::Object(agents)) = doc.get_mut("agents") else {
            unreachable!("providers_mut checked agents")
        };
        agents.remove("providers");
        if agents.0.is_empty() {
            doc.remove("agents");
        }
    }
    outcome.backup = write_config(config, Some(&original), &doc)?;
    Ok(outcome)
}

/// The bytes of the config, `None` if it does not exist.
fn read_config(path: &Path) -> Result<Option<Vec<u8>>, PaseoError> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PaseoError::Read {
            path: path.into(),
            source,
        }),
    }
}

/// The top-level object of the config; a missing or blank file is `{}`.
fn parse(path: &Path, bytes: Option<&[u8]>) -> Result<Object, PaseoError> {
    let Some(bytes) = bytes else {
        return Ok(Object::default());
    };
    let text = std::str::from_utf8(bytes).map_err(|e| PaseoError::Malformed {
        path: path.into(),
        reason: format!(
            "it is not UTF-8 text (bad byte at offset {})",
            e.valid_up_to()
        ),
    })?;
    if text.trim().is_empty() {
        return Ok(Object::default());
    }
    match serde_json::from_str(text) {
        Ok(Json::Object(doc)) => Ok(doc),
        Ok(other) => Err(PaseoError::Shape {
            path: path.into(),
            what: "the top level",
            found: other.kind(),
        }),
        Err(e) => Err(PaseoError::Malformed {
            path: path.into(),
            reason: e.to_string(),
        }),
    }
}

/// `agents.providers` of `doc`, created if `create`; `None` if absent and not created.
/// Either being something else than an object is an error.
fn providers_mut<'a>(
    path: &Path,
    doc: &'a mut Object,
    create: bool,
) -> Result<Option<&'a mut Object>, PaseoError> {
    let shape = |what, found: &Json| PaseoError::Shape {
        path: path.into(),
        what,
        found: found.kind(),
    };
    if create && doc.get("agents").is_none() {
        doc.insert("agents", Json::Object(Object::default()));
    }
    let agents = match doc.get_mut("agents") {
        None => return Ok(None),
        Some(Json::Object(agents)) => agents,
        Some(other) => return Err(shape("\"agents\"", other)),
    };
    if create && agents.get("providers").is_none() {
        agents.insert("providers", Json::Object(Object::default()));
    }
    match agents.get_mut("providers") {
        None => Ok(None),
        Some(Json::Object(providers)) => Ok(Some(providers)),
        Some(other) => Err(shape("\"agents.providers\"", other)),
    }
}

/// Replaces the config (whose content was `original`, `None` if it did not exist) with
/// `doc`: backup first, then an atomic rename. Returns the backup's path.
fn write_config(
    config: &Path,
    original: Option<&[u8]>,
    doc: &Object,
) -> Result<Option<PathBuf>, PaseoError> {
    let write_err = |source| PaseoError::Write {
        path: config.into(),
        source,
    };
    let text = render(doc, original);
    let Some(original) = original else {
        // A link to a file not made yet (dotfiles set up ahead) is written through too.
        let target = link_target(config);
        if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(write_err)?;
        }
        replace(config, &target, None, &text)?;
        return Ok(None);
    };
    // Write through a symlinked config (dotfiles), not over the link.
    let target = fs::canonicalize(config).map_err(write_err)?;
    let metadata = fs::metadata(&target).map_err(write_err)?;
    let backup = backup(config, original, &metadata)?;
    replace(config, &target, Some((original, &metadata)), &text)?;
    Ok(Some(backup))
}

/// Where `path` leads through its links (followed as far as they go, at most 40), if
/// it is one; else `path`.
fn link_target(path: &Path) -> PathBuf {
    let mut target = path.to_path_buf();
    for _ in 0..40 {
        let Ok(link) = fs::read_link(&target) else {
            break;
        };
        target = match target.parent() {
            Some(dir) => dir.join(link),
            None => link,
        };
    }
    target
}

/// The new text of the config, with the indentation and final newline of the old one.
fn render(doc: &Object, original: Option<&[u8]>) -> Vec<u8> {
    let original = original
        .and_then(|b| std::str::from_utf8(b).ok())
        .filter(|t| !t.trim().is_empty());
    let indent = original.map_or("  ", detect_indent);
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    doc.serialize(&mut serializer)
        .expect("serialising JSON into memory cannot fail");
    if original.is_none_or(|t| t.ends_with('\n')) {
        out.push(b'\n');
    }
    out
}

/// The indentation unit of pretty-printed JSON `text`: the leading whitespace of its
/// first indented line (JSON strings cannot span lines), two spaces if none.
fn detect_indent(text: &str) -> &str {
    text.lines()
        .map(|line| {
            let body = line.trim_start_matches([' ', '\t']);
            (&line[..line.len() - body.len()], body)
        })
        .find(|(indent, body)| !indent.is_empty() && !body.is_empty())
        .map_or("  ", |(indent, _)| indent)
}

/// Copies `original` (the config's content) to `<config>.bak-<unix seconds>` beside
/// it, with the config's permissions; never overwrites an existing file.
fn backup(config: &Path, original: &[u8], metadata: &fs::Metadata) -> Result<PathBuf, PaseoError> {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = config
        .file_name()
        .map_or_else(|| OsString::from("config.json"), OsString::from);
    let mode = metadata.permissions().mode() & 0o777;
    for n in 0u32.. {
        let mut file_name = name.clone();
        file_name.push(format!(".bak-{seconds}"));
        if n > 0 {
            file_name.push(format!(".{n}"));
        }
        let path = config.with_file_name(file_name);
        let file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path);
        let mut file = match file {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => continue,
            Err(source) => return Err(PaseoError::Backup { path, source }),
        };
        let written = file
            .set_permissions(fs::Permissions::from_mode(mode))
            .and_then(|()| file.write_all(original))
            .and_then(|()| file.sync_all());
        return match written {
            Ok(()) => Ok(path),
            Err(source) => {
                let _ = fs::remove_file(&path);
                Err(PaseoError::Backup { path, source })
            }
        };
    }
    unreachable!("the loop returns by n == 1000")
}

/// Atomically replaces `target` (the real file behind `config`) with `text`, through a
/// temporary file beside it that gets the old file's permissions and owner (0600 for a
/// new file: Paseo's config can hold API keys). Refuses if the config no longer holds
/// `previous` (its old content; `None`: it did not exist).
fn replace(
    config: &Path,
    target: &Path,
    previous: Option<(&[u8], &fs::Metadata)>,
    text: &[u8],
) -> Result<(), PaseoError> {
    let write_err = |source| PaseoError::Write {
        path: config.into(),
        source,
    };
    let mut tmp_name = OsString::from(".");
    tmp_name.push(target.file_name().unwrap_or_else(|| "config.json".as_ref()));
    tmp_name.push(format!(".vmctl-{}.tmp", std::process::id()));
    let tmp = target.with_file_name(tmp_name);
    let mode = previous.map_or(0o600, |(_, m)| m.permissions().mode() & 0o7777);
    let open = || {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
    };
    let mut file = match open() {
        // Left over from a run with the same pid that was killed.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            fs::remove_file(&tmp).and_then(|()| open())
        }
        other => other,
    }
    .map_err(write_err)?;
    let result: io::Result<bool> = (|| {
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        if let Some((_, metadata)) = previous {
            let ours = file.metadata()?;
            if (ours.uid(), ours.gid()) != (metadata.uid(), metadata.gid()) {
                if let Err(e) =
                    std::os::unix::fs::fchown(&file, Some(metadata.uid()), Some(metadata.gid()))
                {
                    tracing::debug!("cannot give {} its old owner: {e}", tmp.display());
                }
            }
        }
        file.write_all(text)?;
        file.sync_all()?;
        let unchanged = match previous {
            Some((bytes, _)) => read_config(config).ok().flatten().as_deref() == Some(bytes),
            // Still nothing there, a link that leads nowhere included.
            None => fs::metadata(config).is_err_and(|e| e.kind() == io::ErrorKind::NotFound),
        };
        if !unchanged {
            return Ok(false);
        }
        fs::rename(&tmp, target)?;
        Ok(true)
    })();
    match result {
        Ok(true) => {
            if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
                let _ = fs::File::open(dir).and_then(|d| d.sync_all());
            }
            Ok(())
        }
        Ok(false) => {
            let _ = fs::remove_file(&tmp);
            Err(PaseoError::ChangedMeanwhile {
                path: config.into(),
            })
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(write_err(e))
        }
    }
}

/// A JSON value whose objects keep their keys in file order (vmctl's serde_json has no
/// `preserve_order`, and its `Value` would sort them).
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Object),
}

/// A JSON object's members in order. As with JavaScript's `JSON.parse`, a repeated key
/// keeps its first position and its last value.
#[derive(Debug, Clone, Default, PartialEq)]
struct Object(Vec<(String, Json)>);

impl Object {
    fn get(&self, key: &str) -> Option<&Json> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        self.0.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Sets `key`, in place if present, else at the end.
    fn insert(&mut self, key: &str, value: Json) {
        match self.get_mut(key) {
            Some(slot) => *slot = value,
            None => self.0.push((key.to_owned(), value)),
        }
    }

    fn remove(&mut self, key: &str) -> Option<Json> {
        let index = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(index).1)
    }
}

impl Json {
    fn as_object(&self) -> Option<&Object> {
        match self {
            Json::Object(o) => Some(o),
            _ => None,
        }
    }

    /// What kind of value this is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Number(_) => "a number",
            Json::String(_) => "a string",
            Json::Array(_) => "an array",
            Json::Object(_) => "an object",
        }
    }

    /// Equality that ignores the order of object keys.
    fn same(&self, other: &Json) -> bool {
        match (self, other) {
            (Json::Array(a), Json::Array(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same(y))
            }
            (Json::Object(a), Json::Object(b)) => {
                a.0.len() == b.0.len()
                    && a.0.iter().all(|(k, v)| b.get(k).is_some_and(|w| v.same(w)))
            }
            _ => self == other,
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        Json::deserialize(deserializer)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        // serde_json never yields a non-finite float from JSON text.
        Ok(serde_json::Number::from_f64(v).map_or(Json::Null, Json::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut object = Object::default();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            object.insert(&key, value);
        }
        Ok(Json::Object(object))
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => serializer.serialize_unit(),
            Json::Bool(b) => serializer.serialize_bool(*b),
            Json::Number(n) => n.serialize(serializer),
            Json::String(s) => serializer.serialize_str(s),
            Json::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(object) => object.serialize(serializer),
        }
    }
}

impl Serialize for Object {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VMCTL: &str = "/opt/vmctl/bin/vmctl";

    fn value(path: &Path) -> serde_json::Value {
        serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
    }

    fn ours(vmctl: &str) -> serde_json::Value {
        serde_json::json!({
            "claude-vm": {"extends": "claude", "label": "Claude (VM)",
                          "command": [vmctl, "agent", "claude"]},
            "codex-vm": {"extends": "codex", "label": "Codex (VM)",
                         "command": [vmctl, "agent", "codex"]},
        })
    }

    fn backups(dir: &Path) -> Vec<PathBuf> {
        let mut found: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains(".bak-"))
            .collect();
        found.sort();
        found
    }

    /// A config the way Paseo writes it (JSON.stringify, 2 spaces), keys unsorted.
    const EXISTING: &str = r#"{
  "version": 1,
  "daemon": {
    "listen": "127.0.0.1:6767",
    "agentProfiles": []
  },
  "agents": {
    "providers": {
      "zai": {
        "extends": "claude",
        "label": "ZAI",
        "env": {
          "ANTHROPIC_BASE_URL": "https://api.z.ai/api/anthropic"
        },
        "disallowedTools": [
          "WebSearch"
        ]
      },
      "copilot": {
        "enabled": false
      }
    },
    "catalogRefreshTimeoutMs": 180000
  },
  "app": {
    "theme": "dark",
    "ratio": 1.5
  }
}
"#;

    #[test]
    fn config_path_prefers_paseo_home() {
        assert_eq!(
            config_path_from(Some("/srv/paseo".into()), Some("/home/me".into())),
            Some(PathBuf::from("/srv/paseo/config.json"))
        );
        assert_eq!(
            config_path_from(Some("".into()), Some("/home/me".into())),
            Some(PathBuf::from("/home/me/.paseo/config.json"))
        );
        assert_eq!(
            config_path_from(None, Some("/home/me".into())),
            Some(PathBuf::from("/home/me/.paseo/config.json"))
        );
        assert_eq!(config_path_from(None, None), None);
        assert_eq!(config_path_from(Some("".into()), Some("".into())), None);
    }

    #[test]
    fn install_into_missing_config_creates_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("home/.paseo/config.json");
        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        assert!(outcome.created && outcome.changed());
        assert_eq!(outcome.backup, None);
        assert_eq!(
            outcome.providers,
            vec![
                ("claude-vm", InstallChange::Added),
                ("codex-vm", InstallChange::Added)
            ]
        );
        assert_eq!(
            value(&config),
            serde_json::json!({"agents": {"providers": ours(VMCTL)}})
        );
        let mode = fs::metadata(&config).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let text = fs::read_to_string(&config).unwrap();
        assert!(text.ends_with("}\n"), "{text}");
        assert!(text.contains("\n  \"agents\""), "{text}");
        let message = outcome.to_string();
        assert!(message.contains("Created"), "{message}");
        assert!(message.contains("Claude (VM)"), "{message}");
        assert!(
            message.contains(&format!("{VMCTL} agent codex")),
            "{message}"
        );
        // Only the config itself: no temporary file left behind.
        assert_eq!(fs::read_dir(config.parent().unwrap()).unwrap().count(), 1);
    }

    #[test]
    fn install_into_empty_config() {
        for content in ["", "  \n"] {
            let dir = tempfile::tempdir().unwrap();
            let config = dir.path().join("config.json");
            fs::write(&config, content).unwrap();
            let outcome = install(&config, Path::new(VMCTL)).unwrap();
            assert!(!outcome.created);
            assert_eq!(
                value(&config),
                serde_json::json!({"agents": {"providers": ours(VMCTL)}})
            );
            let backup = outcome.backup.expect("backed up");
            assert_eq!(fs::read_to_string(backup).unwrap(), content);
        }
    }

    #[test]
    fn install_into_existing_config_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        fs::write(&config, EXISTING).unwrap();
        fs::set_permissions(&config, fs::Permissions::from_mode(0o640)).unwrap();

        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        let mut expected: serde_json::Value = serde_json::from_str(EXISTING).unwrap();
        let providers = expected["agents"]["providers"].as_object_mut().unwrap();
        for (id, entry) in ours(VMCTL).as_object().unwrap() {
            providers.insert(id.clone(), entry.clone());
        }
        assert_eq!(value(&config), expected);

        // The text is the old one with our entries appended to the providers.
        let text = fs::read_to_string(&config).unwrap();
        let ours_text = format!(
            r#",
      "claude-vm": {{
        "extends": "claude",
        "label": "Claude (VM)",
        "command": [
          "{VMCTL}",
          "agent",
          "claude"
        ]
      }},
      "codex-vm": {{
        "extends": "codex",
        "label": "Codex (VM)",
        "command": [
          "{VMCTL}",
          "agent",
          "codex"
        ]
      }}"#
        );
        let anchor = "\"enabled\": false\n      }";
        assert_eq!(
            text,
            EXISTING.replace(anchor, &format!("{anchor}{ours_text}"))
        );

        let mode = fs::metadata(&config).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let backup = outcome.backup.clone().expect("backed up");
        assert_eq!(backups(dir.path()), vec![backup.clone()]);
        assert_eq!(fs::read_to_string(&backup).unwrap(), EXISTING);
        let backup_mode = fs::metadata(&backup).unwrap().permissions().mode() & 0o777;
        assert_eq!(backup_mode, 0o640);
        assert!(outcome.to_string().contains(&backup.display().to_string()));
    }

    #[test]
    fn second_install_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        fs::write(&config, EXISTING).unwrap();
        install(&config, Path::new(VMCTL)).unwrap();
        let before = fs::read(&config).unwrap();
        let backups_before = backups(dir.path());

        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        assert!(!outcome.changed() && !outcome.created);
        assert_eq!(outcome.backup, None);
        assert_eq!(fs::read(&config).unwrap(), before);
        assert_eq!(backups(dir.path()), backups_before);
        assert!(outcome.to_string().contains("already installed"));
    }

    #[test]
    fn install_replaces_an_entry_with_another_path() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        install(&config, Path::new("/old/vmctl")).unwrap();
        // A hand-made codex-vm.
        let mut doc = value(&config);
        doc["agents"]["providers"]["codex-vm"] =
            serde_json::json!({"extends": "codex", "label": "Mine"});
        fs::write(&config, doc.to_string()).unwrap();

        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        assert_eq!(
            outcome.providers,
            vec![
                (
                    "claude-vm",
                    InstallChange::Replaced {
                        previous_vmctl: Some("/old/vmctl".into())
                    }
                ),
                (
                    "codex-vm",
                    InstallChange::Replaced {
                        previous_vmctl: None
                    }
                ),
            ]
        );
        assert_eq!(value(&config)["agents"]["providers"], ours(VMCTL));
        let message = outcome.to_string();
        assert!(message.contains("it ran /old/vmctl"), "{message}");
        assert!(message.contains("not the entry vmctl writes"), "{message}");
        assert_eq!(
            fs::read_to_string(outcome.backup.unwrap()).unwrap(),
            doc.to_string()
        );
    }

    #[test]
    fn malformed_config_is_reported_and_untouched() {
        let cases: [(&[u8], &str); 5] = [
            (b"{\n  \"agents\": {,\n}", "line 2"),
            (b"[1, 2]", "the top level is an array"),
            (b"{\"agents\": [\"claude\"]}", "\"agents\" is an array"),
            (
                b"{\"agents\": {\"providers\": null}}",
                "\"agents.providers\" is null",
            ),
            (b"{\"a\": \"\xe9\"}", "not UTF-8"),
        ];
        for (bytes, problem) in cases {
            let dir = tempfile::tempdir().unwrap();
            let config = dir.path().join("config.json");
            fs::write(&config, bytes).unwrap();
            for result in [
                install(&config, Path::new(VMCTL)).map(|_| ()),
                uninstall(&config).map(|_| ()),
            ] {
                let message = result.unwrap_err().to_string();
                assert!(message.contains(problem), "{message}");
                assert!(message.contains(&config.display().to_string()), "{message}");
                assert!(message.contains("untouched"), "{message}");
            }
            assert_eq!(fs::read(&config).unwrap(), bytes);
            assert_eq!(
                fs::read_dir(dir.path()).unwrap().count(),
                1,
                "no backup, no temp file"
            );
        }
    }

    #[test]
    fn relative_vmctl_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        let error = install(&config, Path::new("target/debug/vmctl")).unwrap_err();
        assert!(matches!(error, PaseoError::VmctlPath { .. }), "{error}");
        assert!(!config.exists());
    }

    #[test]
    fn uninstall_restores_the_original() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        fs::write(&config, EXISTING).unwrap();
        install(&config, Path::new(VMCTL)).unwrap();
        let installed = fs::read_to_string(&config).unwrap();

        let outcome = uninstall(&config).unwrap();
        assert_eq!(
            outcome.providers,
            vec![
                ("claude-vm", UninstallChange::Removed),
                ("codex-vm", UninstallChange::Removed)
            ]
        );
        assert_eq!(fs::read_to_string(&config).unwrap(), EXISTING);
        let backup = outcome.backup.clone().expect("backed up");
        assert_eq!(fs::read_to_string(backup).unwrap(), installed);
        assert!(outcome
            .to_string()
            .contains("Removed Paseo provider claude-vm"));
    }

    #[test]
    fn uninstall_drops_the_sections_it_emptied() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        fs::write(&config, "{\n    \"version\": 1\n}\n").unwrap();
        install(&config, Path::new(VMCTL)).unwrap();
        assert!(fs::read_to_string(&config)
            .unwrap()
            .contains("\n        \"providers\""));
        uninstall(&config).unwrap();
        assert_eq!(
            fs::read_to_string(&config).unwrap(),
            "{\n    \"version\": 1\n}\n"
        );
    }

    #[test]
    fn uninstall_leaves_a_modified_entry() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        install(&config, Path::new(VMCTL)).unwrap();
        let mut doc = value(&config);
        doc["agents"]["providers"]["codex-vm"]["env"] = serde_json::json!({"X": "1"});
        doc["agents"]["providers"]["other"] =
            serde_json::json!({"extends": "claude", "label": "Other"});
        fs::write(&config, serde_json::to_string_pretty(&doc).unwrap()).unwrap();

        let outcome = uninstall(&config).unwrap();
        assert_eq!(
            outcome.providers,
            vec![
                ("claude-vm", UninstallChange::Removed),
                ("codex-vm", UninstallChange::KeptModified)
            ]
        );
        let after = value(&config);
        let providers = after["agents"]["providers"].as_object().unwrap();
        assert_eq!(
            providers.keys().collect::<Vec<_>>(),
            vec!["codex-vm", "other"]
        );
        assert_eq!(
            providers["codex-vm"],
            doc["agents"]["providers"]["codex-vm"]
        );
        let message = outcome.to_string();
        assert!(
            message.contains("Left Paseo provider codex-vm in place"),
            "{message}"
        );
        assert!(
            message.contains("Removed Paseo provider claude-vm"),
            "{message}"
        );

        // Only the modified one is left: a second uninstall writes nothing.
        let before = fs::read(&config).unwrap();
        let outcome = uninstall(&config).unwrap();
        assert!(!outcome.changed() && outcome.backup.is_none());
        assert_eq!(fs::read(&config).unwrap(), before);
    }

    #[test]
    fn uninstall_when_not_installed_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        let outcome = uninstall(&config).unwrap();
        assert!(outcome.missing_file && !outcome.changed());
        assert!(outcome.to_string().contains("does not exist"));
        assert!(!config.exists());

        for content in ["", "{}", EXISTING] {
            fs::write(&config, content).unwrap();
            let outcome = uninstall(&config).unwrap();
            assert!(!outcome.changed() && outcome.backup.is_none());
            assert!(outcome.to_string().contains("nothing changed"), "{outcome}");
            assert_eq!(fs::read_to_string(&config).unwrap(), content);
        }
        assert_eq!(backups(dir.path()), Vec::<PathBuf>::new());
    }

    #[test]
    fn symlinked_config_is_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("dotfiles/paseo.json");
        fs::create_dir_all(real.parent().unwrap()).unwrap();
        fs::write(&real, "{}\n").unwrap();
        let config = dir.path().join("config.json");
        std::os::unix::fs::symlink(&real, &config).unwrap();

        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        assert!(fs::symlink_metadata(&config)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(value(&real)["agents"]["providers"], ours(VMCTL));
        assert_eq!(outcome.backup.unwrap().parent(), Some(dir.path()));
    }

    /// A link to a config not made yet is written through as well, the link kept.
    /// (Review: the file was taken for one made meanwhile, and every install failed
    /// with "run the command again".)
    #[test]
    fn a_link_to_a_config_not_made_yet_is_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("dotfiles/paseo/config.json");
        let config = dir.path().join("config.json");
        std::os::unix::fs::symlink("dotfiles/paseo/config.json", &config).unwrap();

        let outcome = install(&config, Path::new(VMCTL)).unwrap();
        assert!(fs::symlink_metadata(&config)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(value(&real)["agents"]["providers"], ours(VMCTL));
        assert!(outcome.backup.is_none());
    }

    #[test]
    fn backups_do_not_overwrite_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        fs::write(&config, "{}").unwrap();
        let metadata = fs::metadata(&config).unwrap();
        let first = backup(&config, b"one", &metadata).unwrap();
        let second = backup(&config, b"two", &metadata).unwrap();
        assert_ne!(first, second);
        assert_eq!(fs::read(first).unwrap(), b"one");
        assert_eq!(fs::read(second).unwrap(), b"two");
    }

    #[test]
    fn json_keeps_order_and_values() {
        let text = r#"{"z": 1, "a": [true, null, -2, 3.25, 18446744073709551615], "m": {"y": "é\n", "b": {}}, "z": 2}"#;
        let doc: Json = serde_json::from_str(text).unwrap();
        assert_eq!(
            serde_json::to_string(&doc).unwrap(),
            r#"{"z":2,"a":[true,null,-2,3.25,18446744073709551615],"m":{"y":"é\n","b":{}}}"#
        );
        assert_eq!(detect_indent("{\n\t\"a\": 1\n}"), "\t");
        assert_eq!(detect_indent("{}"), "  ");
        assert_eq!(detect_indent("{\n}"), "  ");
    }
}
