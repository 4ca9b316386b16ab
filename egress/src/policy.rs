//! The network policy: host patterns, the allow/deny store behind `vmctl policy`, the
//! default allow list and the effective [`Policy`] of one workspace.
//!
//! The store is a JSON file chosen by the caller (vmctl uses
//! `$XDG_CONFIG_HOME/vmctl/policy.json`):
//!
//! ```json
//! {"global": {"allow": ["*.example.com"], "deny": []},
//!  "workspaces": {"/home/me/project": {"allow": ["pypi.example.org:443"], "deny": []}}}
//! ```
//!
//! A workspace's effective policy is [`DEFAULT_ALLOW`] + the global scope + its own
//! scope. A deny rule wins over any allow rule, whatever their scopes; within one scope
//! the last `allow`/`deny` of a pattern wins (adding it to one list takes it off the
//! other).

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::rules::Decision;

/// What the agents need to work, and nothing else; every entry on port 443 only.
pub const DEFAULT_ALLOW: &[&str] = &[
    // Claude Code: the API, its feature flags (Statsig), sign-in and the console.
    // Its error reports go to sentry.io: deliberately left out, they are not needed
    // to work and would send crash context to a third party. Allow `*.sentry.io` to
    // opt in.
    "api.anthropic.com:443",
    "statsig.anthropic.com:443",
    "console.anthropic.com:443",
    "claude.ai:443",
    // Codex: the API, the ChatGPT-account backend and its sign-in.
    "api.openai.com:443",
    "chatgpt.com:443",
    "auth.openai.com:443",
    // GitHub: the site (git over HTTPS), the API, archives, raw files and releases.
    "github.com:443",
    "api.github.com:443",
    "codeload.github.com:443",
    "*.githubusercontent.com:443",
    // Package registries: npm and PyPI (index and files).
    "registry.npmjs.org:443",
    "pypi.org:443",
    "files.pythonhosted.org:443",
];

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{input:?} is not a valid host pattern: {reason}")]
    Pattern { input: String, reason: String },
    #[error("workspace {}: {reason}", .path.display())]
    Workspace { path: PathBuf, reason: String },
    #[error("cannot read the policy file {}: {source}; fix its permissions or move it away", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("the policy file {} is malformed ({message}); fix it by hand, or move it away to start from an empty policy", .path.display())]
    Malformed { path: PathBuf, message: String },
    #[error("cannot write the policy file {}: {source}", .path.display())]
    Write { path: PathBuf, source: io::Error },
}

fn pattern_error(input: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Pattern {
        input: input.to_owned(),
        reason: reason.into(),
    }
}

/// A destination pattern: `host`, `*.domain` (any subdomain at any depth, not the
/// apex), an IPv4 address or a bracketed IPv6 one, each with an optional `:port`.
/// Case-insensitive; a trailing dot is ignored. [`fmt::Display`] gives the canonical
/// form, which is how patterns are stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Pattern {
    host: HostPattern,
    port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum HostPattern {
    /// One host name or IPv4 address, lower-case.
    Exact(String),
    /// `*.domain`: the subdomains of `domain` (stored without `*.`).
    Subdomains(String),
    Ipv6(Ipv6Addr),
}

/// Second-level domains under which countries' registries sell names
/// (`example.co.uk`): `*.co.uk` is every British company's site.
const REGISTRY_SECOND_LEVELS: [&str; 18] = [
    "ac", "co", "com", "edu", "go", "gob", "gov", "govt", "gv", "ltd", "me", "mil", "ne", "net",
    "nom", "or", "org", "plc",
];

/// Hosting domains whose subdomains are their users' sites, anyone's to get.
const HOSTING_DOMAINS: [&str; 29] = [
    "appspot.com",
    "azurewebsites.net",
    "blogspot.com",
    "cloudfront.net",
    "deno.dev",
    "firebaseapp.com",
    "fly.dev",
    "github.io",
    "gitlab.io",
    "glitch.me",
    "herokuapp.com",
    "hf.space",
    "netlify.app",
    "ngrok-free.app",
    "ngrok.app",
    "ngrok.dev",
    "ngrok.io",
    "onrender.com",
    "pages.dev",
    "r2.dev",
    "readthedocs.io",
    "replit.dev",
    "run.app",
    "surge.sh",
    "trycloudflare.com",
    "up.railway.app",
    "vercel.app",
    "web.app",
    "workers.dev",
];

impl Pattern {
    /// The port the pattern is limited to, if any.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// Whether this is a `*.domain` pattern of a domain under which anyone can get a
    /// name of their own: a top-level domain (`*.com`, `*.internal`), a country's
    /// registry domain (`*.co.uk`, `*.com.au`), or a hosting domain that hands out
    /// subdomains (`*.github.io`, `*.vercel.app`). The common cases, from lists: not
    /// the whole Public Suffix List.
    pub fn covers_a_public_suffix(&self) -> bool {
        let HostPattern::Subdomains(domain) = &self.host else {
            return false;
        };
        match domain.split_once('.') {
            None => true,
            _ if HOSTING_DOMAINS.contains(&domain.as_str()) => true,
            Some((second, country)) => {
                country.len() == 2
                    && !country.contains('.')
                    && REGISTRY_SECOND_LEVELS.contains(&second)
            }
        }
    }

    /// The pattern limited to `port` if it names no port yet.
    pub fn with_default_port(mut self, port: u16) -> Pattern {
        self.port.get_or_insert(port);
        self
    }

    /// Whether `host:port` matches. `host` is lower-case, without a trailing dot and
    /// without brackets around an IPv6 address.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match &self.host {
            HostPattern::Exact(name) => host == name,
            HostPattern::Subdomains(domain) => host
                .strip_suffix(domain.as_str())
                .is_some_and(|prefix| prefix.len() > 1 && prefix.ends_with('.')),
            HostPattern::Ipv6(addr) => {
                let bare = host
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .unwrap_or(host);
                bare.parse::<Ipv6Addr>().is_ok_and(|a| a == *addr)
            }
        }
    }
}

impl FromStr for Pattern {
    type Err = PolicyError;

    fn from_str(input: &str) -> Result<Pattern, PolicyError> {
        let text = input.trim().to_ascii_lowercase();
        if text.is_empty() {
            return Err(pattern_error(input, "it is empty"));
        }
        if text.contains("://") || text.contains('/') {
            return Err(pattern_error(
                input,
                "give a host name, not a URL (e.g. example.com or example.com:443)",
            ));
        }
        if let Some(rest) = text.strip_prefix('[') {
            let Some((addr, after)) = rest.split_once(']') else {
                return Err(pattern_error(input, "missing ']' after the IPv6 address"));
            };
            let port = match after {
                "" => None,
                _ => match after.strip_prefix(':') {
                    Some(port) => Some(parse_port(input, port)?),
                    None => {
                        return Err(pattern_error(
                            input,
                            "only ':PORT' may follow ']' (e.g. [::1]:443)",
                        ))
                    }
                },
            };
            let addr = addr
                .parse::<Ipv6Addr>()
                .map_err(|_| pattern_error(input, format!("{addr:?} is not an IPv6 address")))?;
            return Ok(Pattern {
                host: HostPattern::Ipv6(addr),
                port,
            });
        }
        let (host, port) = match text.matches(':').count() {
            0 => (text.as_str(), None),
            1 => {
                let (host, port) = text.split_once(':').unwrap_or((&text, ""));
                (host, Some(parse_port(input, port)?))
            }
            _ => {
                return Err(pattern_error(
                    input,
                    "write IPv6 addresses in brackets, e.g. [::1] or [::1]:443",
                ))
            }
        };
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.is_empty() {
            return Err(pattern_error(input, "the host is empty"));
        }
        let (wildcard, name) = match host.strip_prefix("*.") {
            Some(domain) => (true, domain),
            None => (false, host),
        };
        if name.contains('*') {
            return Err(pattern_error(
                input,
                "'*' is only allowed as a leading '*.' (e.g. *.example.com); a bare '*' is not supported",
            ));
        }
        check_host_name(input, name)?;
        let last_label = name.rsplit('.').next().unwrap_or(name);
        if last_label.bytes().all(|b| b.is_ascii_digit()) {
            let addr = name.parse::<Ipv4Addr>().map_err(|_| {
                pattern_error(
                    input,
                    format!("{name:?} is neither a host name nor an IPv4 address"),
                )
            })?;
            if wildcard {
                return Err(pattern_error(input, "'*.' cannot precede an IP address"));
            }
            return Ok(Pattern {
                host: HostPattern::Exact(addr.to_string()),
                port,
            });
        }
        let host = if wildcard {
            HostPattern::Subdomains(name.to_owned())
        } else {
            HostPattern::Exact(name.to_owned())
        };
        Ok(Pattern { host, port })
    }
}

fn parse_port(input: &str, port: &str) -> Result<u16, PolicyError> {
    if port.is_empty() {
        return Err(pattern_error(input, "the port after ':' is missing"));
    }
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(pattern_error(
            input,
            format!("port {port:?} is not a number between 1 and 65535"),
        ));
    }
    match port.parse::<u16>() {
        Ok(0) => Err(pattern_error(input, "port 0 is not a valid port")),
        Ok(p) => Ok(p),
        Err(_) => Err(pattern_error(
            input,
            format!("port {port} is not a number between 1 and 65535"),
        )),
    }
}

/// Checks a lower-case host name (no wildcard, no trailing dot).
fn check_host_name(input: &str, name: &str) -> Result<(), PolicyError> {
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        let reason = if c.is_ascii() {
            format!("{c:?} cannot appear in a host name")
        } else {
            format!("{c:?} is not ASCII; write internationalized names in punycode (xn--...)")
        };
        return Err(pattern_error(input, reason));
    }
    if name.len() > 253 {
        return Err(pattern_error(input, "the host name is over 253 characters"));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(pattern_error(
                input,
                "the host name has an empty label (a leading dot or two dots in a row)",
            ));
        }
        if label.len() > 63 {
            return Err(pattern_error(
                input,
                format!("the label {label:?} is over 63 characters"),
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(pattern_error(
                input,
                format!("the label {label:?} starts or ends with '-'"),
            ));
        }
    }
    Ok(())
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostPattern::Exact(name) => f.write_str(name)?,
            HostPattern::Subdomains(domain) => write!(f, "*.{domain}")?,
            HostPattern::Ipv6(addr) => write!(f, "[{addr}]")?,
        }
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

impl TryFrom<String> for Pattern {
    type Error = PolicyError;
    fn try_from(text: String) -> Result<Pattern, PolicyError> {
        text.parse()
    }
}

impl From<Pattern> for String {
    fn from(pattern: Pattern) -> String {
        pattern.to_string()
    }
}

/// `host:port` as a person reads it (IPv6 in brackets).
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Where `vmctl policy allow|deny|rm` applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every workspace.
    Global,
    /// One workspace, by its absolute (canonical) path: the same path the VM of that
    /// workspace is started with.
    Workspace(PathBuf),
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Global => f.write_str("global"),
            Scope::Workspace(path) => write!(f, "workspace {}", path.display()),
        }
    }
}

/// The allow and deny lists of one scope.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeRules {
    #[serde(default)]
    pub allow: Vec<Pattern>,
    #[serde(default)]
    pub deny: Vec<Pattern>,
}

impl ScopeRules {
    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    global: ScopeRules,
    #[serde(default)]
    workspaces: BTreeMap<PathBuf, ScopeRules>,
}

/// The policy file: the global scope and each workspace's. Load it, change it, save it.
/// A malformed file fails [`PolicyStore::load`], so it is never overwritten.
#[derive(Debug, Clone)]
pub struct PolicyStore {
    path: PathBuf,
    file: PolicyFile,
}

impl PolicyStore {
    /// Reads the store at `path`; a missing file is an empty store.
    pub fn load(path: impl Into<PathBuf>) -> Result<PolicyStore, PolicyError> {
        let path = path.into();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(PolicyStore {
                    path,
                    file: PolicyFile::default(),
                })
            }
            Err(source) => return Err(PolicyError::Read { path, source }),
        };
        let file: PolicyFile = match serde_json::from_str(&text) {
            Ok(file) => file,
            Err(e) => {
                return Err(PolicyError::Malformed {
                    path,
                    message: e.to_string(),
                })
            }
        };
        if let Some(relative) = file.workspaces.keys().find(|p| !p.is_absolute()) {
            let message = format!(
                "workspace {:?} is not an absolute path",
                relative.display().to_string()
            );
            return Err(PolicyError::Malformed { path, message });
        }
        Ok(PolicyStore { path, file })
    }

    /// The file this store was loaded from and saves to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Allows `patterns` in `scope`, taking them off the scope's deny list.
    pub fn allow(&mut self, scope: &Scope, patterns: &[Pattern]) -> Result<(), PolicyError> {
        let rules = self.scope_mut(scope)?;
        for pattern in patterns {
            rules.deny.retain(|p| p != pattern);
            if !rules.allow.contains(pattern) {
                rules.allow.push(pattern.clone());
            }
        }
        self.prune();
        Ok(())
    }

    /// Denies `patterns` in `scope`, taking them off the scope's allow list.
    pub fn deny(&mut self, scope: &Scope, patterns: &[Pattern]) -> Result<(), PolicyError> {
        let rules = self.scope_mut(scope)?;
        for pattern in patterns {
            rules.allow.retain(|p| p != pattern);
            if !rules.deny.contains(pattern) {
                rules.deny.push(pattern.clone());
            }
        }
        self.prune();
        Ok(())
    }

    /// Takes `patterns` off both lists of `scope`; returns how many rules went.
    /// The defaults cannot be removed: deny them instead.
    pub fn remove(&mut self, scope: &Scope, patterns: &[Pattern]) -> usize {
        let rules = match scope {
            Scope::Global => &mut self.file.global,
            Scope::Workspace(path) => match self.file.workspaces.get_mut(path) {
                Some(rules) => rules,
                None => return 0,
            },
        };
        let before = rules.allow.len() + rules.deny.len();
        rules.allow.retain(|p| !patterns.contains(p));
        rules.deny.retain(|p| !patterns.contains(p));
        let removed = before - rules.allow.len() - rules.deny.len();
        self.prune();
        removed
    }

    /// The rules of one scope (empty if it has none).
    pub fn scope(&self, scope: &Scope) -> ScopeRules {
        match scope {
            Scope::Global => self.file.global.clone(),
            Scope::Workspace(path) => self.file.workspaces.get(path).cloned().unwrap_or_default(),
        }
    }

    /// Every workspace that has rules of its own.
    pub fn workspaces(&self) -> impl Iterator<Item = (&Path, &ScopeRules)> {
        self.file
            .workspaces
            .iter()
            .map(|(path, rules)| (path.as_path(), rules))
    }

    /// The effective policy of `workspace`: defaults + global + its own rules.
    pub fn policy(&self, workspace: &Path) -> Policy {
        let mut policy = Policy::defaults();
        policy.push_scope(&self.file.global, Source::Global);
        if let Some(rules) = self.file.workspaces.get(workspace) {
            policy.push_scope(rules, Source::Workspace);
        }
        policy
    }

    /// Writes the store atomically (a temporary file in the same directory, renamed
    /// over the old one), creating the directory (0700) if needed.
    pub fn save(&self) -> Result<(), PolicyError> {
        let mut text =
            serde_json::to_string_pretty(&self.file).map_err(|e| PolicyError::Write {
                path: self.path.clone(),
                source: io::Error::other(e),
            })?;
        text.push('\n');
        write_atomically(&self.path, text.as_bytes(), 0o644).map_err(|source| PolicyError::Write {
            path: self.path.clone(),
            source,
        })
    }

    fn scope_mut(&mut self, scope: &Scope) -> Result<&mut ScopeRules, PolicyError> {
        match scope {
            Scope::Global => Ok(&mut self.file.global),
            Scope::Workspace(path) => {
                if !path.is_absolute() {
                    return Err(PolicyError::Workspace {
                        path: path.clone(),
                        reason: "not an absolute path".into(),
                    });
                }
                if path.to_str().is_none() {
                    return Err(PolicyError::Workspace {
                        path: path.clone(),
                        reason: "the path is not valid UTF-8 and cannot be stored".into(),
                    });
                }
                Ok(self.file.workspaces.entry(path.clone()).or_default())
            }
        }
    }

    /// Drops workspaces left without rules.
    fn prune(&mut self) {
        self.file.workspaces.retain(|_, rules| !rules.is_empty());
    }
}

/// Writes `data` to `path` atomically: a new file in the same directory, synced, then
/// renamed over `path`. Created with `mode` (before the umask), or, over a file
/// already there, with that file's mode within `mode` (a user's 0600 policy stays
/// 0600). Where `path` is a link (dotfiles kept by stow or chezmoi), the file it leads
/// to is the one replaced, and the link stays. The directory is created 0700 if
/// missing. Shared with the secret store.
pub(crate) fn write_atomically(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if resolved == path {
        return replace_file(path, data, mode);
    }
    // The caller names the link; the failure is the place it leads to (a read-only
    // /nix/store, say), which the message must name.
    replace_file(&resolved, data, mode).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "it links to {}, which cannot be replaced: {e}",
                resolved.display()
            ),
        )
    })
}

/// [`write_atomically`] once `path` is no link.
fn replace_file(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let mode = match std::fs::metadata(path) {
        Ok(existing) => existing.permissions().mode() & mode,
        Err(_) => mode,
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let mut attempt = 0u32;
    let (tmp, mut file) = loop {
        let tmp = dir.join(format!(
            ".{}.{}.{attempt}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
        {
            Ok(file) => break (tmp, file),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
            Err(e) => return Err(e),
        }
    };
    let written = file
        .write_all(data)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // Make the rename itself durable; failing to is no reason to report a failure.
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Whether a rule lets traffic through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Allow,
    Deny,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
        })
    }
}

/// Where a rule of the effective policy comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// [`DEFAULT_ALLOW`].
    Default,
    /// The global scope of the policy file.
    Global,
    /// The workspace's own scope.
    Workspace,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Default => "default",
            Source::Global => "global",
            Source::Workspace => "workspace",
        })
    }
}

/// One rule of the effective policy; displays as `deny *.example.com (global)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub action: Action,
    pub pattern: Pattern,
    pub source: Source,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ({})", self.action, self.pattern, self.source)
    }
}

/// The effective rules of one workspace, in order: defaults, global, workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    rules: Vec<Rule>,
}

impl Policy {
    /// The default allow list alone.
    pub fn defaults() -> Policy {
        let rules = DEFAULT_ALLOW
            .iter()
            .map(|text| Rule {
                action: Action::Allow,
                pattern: text.parse().expect("DEFAULT_ALLOW holds valid patterns"),
                source: Source::Default,
            })
            .collect();
        Policy { rules }
    }

    fn push_scope(&mut self, rules: &ScopeRules, source: Source) {
        let allow = rules.allow.iter().map(|p| (Action::Allow, p));
        let deny = rules.deny.iter().map(|p| (Action::Deny, p));
        self.rules
            .extend(allow.chain(deny).map(|(action, pattern)| Rule {
                action,
                pattern: pattern.clone(),
                source,
            }));
    }

    /// Every rule, for `vmctl policy ls`.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// May `host:port` be reached? Any matching deny rule wins; otherwise the first
    /// matching allow rule allows; otherwise the destination is refused.
    pub fn decide(&self, host: &str, port: u16) -> Decision {
        let find = |action: Action| {
            self.rules
                .iter()
                .find(|r| r.action == action && r.pattern.matches(host, port))
        };
        if let Some(rule) = find(Action::Deny) {
            return Decision {
                allowed: false,
                rule: rule.to_string(),
            };
        }
        match find(Action::Allow) {
            Some(rule) => Decision {
                allowed: true,
                rule: rule.to_string(),
            },
            None => Decision {
                allowed: false,
                rule: format!("no allow rule matches {}", host_port(host, port)),
            },
        }
    }
}

#[cfg(test)]
mod tests {

    /// A rewrite keeps the file's own mode within the one asked for, and replaces the
    /// file a link leads to, not the link. (Review: a user's 0600 policy came back
    /// 0644, and a dotfiles link became a file of its own, the dotfile no longer
    /// written.)
    #[test]
    fn a_rewrite_keeps_the_mode_and_writes_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let dotfile = dir.path().join("dotfiles/policy.json");
        std::fs::create_dir_all(dotfile.parent().unwrap()).unwrap();
        std::fs::write(&dotfile, "old").unwrap();
        std::fs::set_permissions(&dotfile, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("policy.json");
        std::os::unix::fs::symlink(&dotfile, &link).unwrap();

        super::write_atomically(&link, b"new", 0o644).unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read_to_string(&dotfile).unwrap(), "new");
        let mode = |path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dotfile), 0o600);
        // Never wider than asked: a secret store made 0644 by hand comes back 0600.
        std::fs::set_permissions(&dotfile, std::fs::Permissions::from_mode(0o644)).unwrap();
        super::write_atomically(&link, b"newer", 0o600).unwrap();
        assert_eq!(mode(&dotfile), 0o600);
        // A new file gets the mode asked for (within the umask).
        let fresh = dir.path().join("fresh.json");
        super::write_atomically(&fresh, b"{}", 0o600).unwrap();
        assert_eq!(mode(&fresh), 0o600);
    }

    /// A link into a place that cannot be written (a read-only /nix/store) fails
    /// naming that place, not only the link. (Review: the error named the link alone.)
    #[test]
    fn a_link_to_a_file_that_cannot_be_replaced_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("policy.json");
        std::os::unix::fs::symlink("/proc/version", &link).unwrap();
        let err = super::write_atomically(&link, b"{}", 0o644).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("it links to /proc/version, which cannot be replaced: "),
            "{err}"
        );
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    }

    #[test]
    fn wildcards_of_domains_anyone_can_have_a_name_under_are_told() {
        let broad = |text: &str| text.parse::<Pattern>().unwrap().covers_a_public_suffix();
        for pattern in [
            "*.com",
            "*.internal",
            "*.co.uk",
            "*.com.au",
            "*.GitHub.io",
            "*.vercel.app:443",
        ] {
            assert!(broad(pattern), "{pattern}");
        }
        for pattern in [
            "*.example.com",
            "*.example.co.uk",
            "*.corp.example",
            "*.api.co",
            "user.github.io",
            "co.uk",
            "api.example.com",
        ] {
            assert!(!broad(pattern), "{pattern}");
        }
    }
    use super::*;

    fn p(text: &str) -> Pattern {
        text.parse()
            .unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
    }

    fn parse_err(text: &str) -> String {
        match text.parse::<Pattern>() {
            Ok(p) => panic!("{text:?} should not parse, got {p}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn canonical_forms() {
        for (input, canonical) in [
            ("example.com", "example.com"),
            ("Example.COM.", "example.com"),
            ("  example.com:443 ", "example.com:443"),
            ("example.com.:8443", "example.com:8443"),
            ("*.Example.com", "*.example.com"),
            ("*.example.com.:443", "*.example.com:443"),
            ("[::1]", "[::1]"),
            ("[0:0:0:0:0:0:0:1]:443", "[::1]:443"),
            ("[2001:DB8::A]", "[2001:db8::a]"),
            ("127.0.0.1:80", "127.0.0.1:80"),
            ("my_host.internal", "my_host.internal"),
            ("localhost", "localhost"),
        ] {
            assert_eq!(p(input).to_string(), canonical, "{input}");
            assert_eq!(p(canonical), p(input));
        }
    }

    #[test]
    fn bad_patterns_say_why() {
        for (input, why) in [
            ("", "empty"),
            ("   ", "empty"),
            ("*", "leading '*.'"),
            ("a.*.com", "leading '*.'"),
            ("*example.com", "leading '*.'"),
            ("**.example.com", "leading '*.'"),
            ("*.", "leading '*.'"),
            ("example.com:0", "port 0"),
            ("example.com:http", "not a number"),
            ("example.com:+443", "not a number"),
            ("example.com:65536", "between 1 and 65535"),
            ("example.com:", "missing"),
            (":443", "host is empty"),
            ("::1", "brackets"),
            ("[::1", "missing ']'"),
            ("[::1]443", "only ':PORT'"),
            ("[example.com]", "not an IPv6 address"),
            ("https://example.com", "not a URL"),
            ("example.com/path", "not a URL"),
            ("exa mple.com", "cannot appear"),
            ("exämple.com", "punycode"),
            ("a..b", "empty label"),
            (".example.com", "empty label"),
            ("-a.com", "starts or ends with '-'"),
            ("1.2.3.256", "neither a host name nor an IPv4"),
            ("*.10.0.0.1", "cannot precede an IP"),
        ] {
            let message = parse_err(input);
            assert!(message.contains(why), "{input:?}: {message}");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(parse_err(&long_label).contains("over 63"));
    }

    #[test]
    fn exact_and_port_matching() {
        let any_port = p("example.com");
        assert!(any_port.matches("example.com", 443));
        assert!(any_port.matches("example.com", 8080));
        assert!(!any_port.matches("www.example.com", 443));
        assert!(!any_port.matches("example.com.evil", 443));
        assert!(!any_port.matches("notexample.com", 443));
        let tls = p("Example.com.:443");
        assert!(tls.matches("example.com", 443));
        assert!(!tls.matches("example.com", 80));
    }

    #[test]
    fn wildcard_matches_subdomains_not_apex() {
        let wild = p("*.example.com");
        assert!(wild.matches("a.example.com", 443));
        assert!(wild.matches("a.b.c.example.com", 1));
        assert!(!wild.matches("example.com", 443));
        assert!(!wild.matches("badexample.com", 443));
        assert!(!wild.matches(".example.com", 443));
        assert!(!wild.matches("example.com.org", 443));
        let wild_tls = p("*.EXAMPLE.com:443");
        assert!(wild_tls.matches("x.example.com", 443));
        assert!(!wild_tls.matches("x.example.com", 80));
    }

    #[test]
    fn ip_matching() {
        let v6 = p("[::1]:443");
        assert!(v6.matches("::1", 443));
        assert!(v6.matches("0:0::1", 443));
        assert!(v6.matches("[::1]", 443));
        assert!(!v6.matches("::1", 80));
        assert!(!v6.matches("::2", 443));
        assert!(!v6.matches("localhost", 443));
        let v6_any = p("[2001:db8::1]");
        assert!(v6_any.matches("2001:db8::1", 22));
        let v4 = p("10.0.0.1");
        assert!(v4.matches("10.0.0.1", 5432));
        assert!(!v4.matches("10.0.0.10", 5432));
    }

    #[test]
    fn defaults_parse_are_tls_only_and_cover_the_agents() {
        let policy = Policy::defaults();
        assert_eq!(policy.rules().len(), DEFAULT_ALLOW.len());
        for rule in policy.rules() {
            assert_eq!(rule.pattern.port(), Some(443), "{rule}");
            assert_eq!(rule.source, Source::Default);
        }
        for host in [
            "api.anthropic.com",
            "api.openai.com",
            "chatgpt.com",
            "github.com",
            "objects.githubusercontent.com",
            "raw.githubusercontent.com",
            "registry.npmjs.org",
            "files.pythonhosted.org",
        ] {
            assert!(policy.decide(host, 443).allowed, "{host}");
            assert!(!policy.decide(host, 80).allowed, "{host}:80");
        }
        let d = policy.decide("api.anthropic.com", 443);
        assert_eq!(d.rule, "allow api.anthropic.com:443 (default)");
        for host in ["example.org", "sentry.io", "githubusercontent.com"] {
            let d = policy.decide(host, 443);
            assert!(!d.allowed, "{host}");
            assert_eq!(d.rule, format!("no allow rule matches {host}:443"));
        }
        assert_eq!(
            policy.decide("::1", 443).rule,
            "no allow rule matches [::1]:443"
        );
    }

    fn store_in(dir: &tempfile::TempDir) -> PolicyStore {
        PolicyStore::load(dir.path().join("vmctl/policy.json")).unwrap()
    }

    #[test]
    fn deny_wins_across_scopes() {
        let dir = tempfile::tempdir().unwrap();
        let ws = PathBuf::from("/home/me/project");
        let mut store = store_in(&dir);
        store
            .allow(&Scope::Workspace(ws.clone()), &[p("*.example.com")])
            .unwrap();
        store
            .deny(&Scope::Global, &[p("evil.example.com"), p("github.com")])
            .unwrap();
        let policy = store.policy(&ws);
        let d = policy.decide("www.example.com", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (true, "allow *.example.com (workspace)")
        );
        let d = policy.decide("evil.example.com", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "deny evil.example.com (global)")
        );
        // A global deny beats a default allow.
        let d = policy.decide("github.com", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "deny github.com (global)")
        );
        // A workspace deny beats a global allow.
        store
            .allow(&Scope::Global, &[p("pypi.example.org")])
            .unwrap();
        store
            .deny(&Scope::Workspace(ws.clone()), &[p("*.example.org")])
            .unwrap();
        let d = store.policy(&ws).decide("pypi.example.org", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "deny *.example.org (workspace)")
        );
        // Another workspace only sees the global rules.
        let other = store.policy(Path::new("/elsewhere"));
        assert!(!other.decide("www.example.com", 443).allowed);
        assert!(other.decide("pypi.example.org", 443).allowed);
        let sources: Vec<String> = store
            .policy(&ws)
            .rules()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert!(sources.contains(&"deny *.example.org (workspace)".to_owned()));
        assert!(sources.contains(&"allow pypi.example.org (global)".to_owned()));
    }

    #[test]
    fn last_command_wins_within_a_scope() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store_in(&dir);
        let x = p("x.example.com");
        store
            .deny(&Scope::Global, std::slice::from_ref(&x))
            .unwrap();
        store
            .allow(&Scope::Global, std::slice::from_ref(&x))
            .unwrap();
        store
            .allow(&Scope::Global, std::slice::from_ref(&x))
            .unwrap();
        assert_eq!(
            store.scope(&Scope::Global),
            ScopeRules {
                allow: vec![x.clone()],
                deny: vec![]
            }
        );
        store
            .deny(&Scope::Global, std::slice::from_ref(&x))
            .unwrap();
        assert_eq!(
            store.scope(&Scope::Global),
            ScopeRules {
                allow: vec![],
                deny: vec![x.clone()]
            }
        );
        assert!(
            !store
                .policy(Path::new("/w"))
                .decide("x.example.com", 443)
                .allowed
        );
    }

    #[test]
    fn remove_counts_and_prunes() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store_in(&dir);
        let ws = Scope::Workspace(PathBuf::from("/w"));
        store.allow(&ws, &[p("a.com"), p("b.com")]).unwrap();
        store.deny(&ws, &[p("c.com")]).unwrap();
        assert_eq!(store.remove(&ws, &[p("A.com."), p("c.com"), p("d.com")]), 2);
        assert_eq!(store.workspaces().count(), 1);
        assert_eq!(store.remove(&ws, &[p("b.com")]), 1);
        assert_eq!(store.workspaces().count(), 0);
        assert_eq!(store.remove(&Scope::Global, &[p("b.com")]), 0);
        assert_eq!(
            store.remove(&Scope::Workspace("/none".into()), &[p("b.com")]),
            0
        );
    }

    #[test]
    fn relative_workspace_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store_in(&dir);
        let err = store
            .allow(&Scope::Workspace("project".into()), &[p("a.com")])
            .unwrap_err();
        assert!(err.to_string().contains("not an absolute path"), "{err}");
    }

    #[test]
    fn round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cfg/vmctl/policy.json");
        let mut store = PolicyStore::load(&path).unwrap();
        let ws = Scope::Workspace(PathBuf::from("/home/me/project"));
        store.allow(&Scope::Global, &[p("*.Example.com")]).unwrap();
        store.deny(&Scope::Global, &[p("[::1]:22")]).unwrap();
        store.allow(&ws, &[p("pypi.example.org:443")]).unwrap();
        store.save().unwrap();

        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "global": {"allow": ["*.example.com"], "deny": ["[::1]:22"]},
                "workspaces": {"/home/me/project": {"allow": ["pypi.example.org:443"], "deny": []}}
            })
        );
        let again = PolicyStore::load(&path).unwrap();
        assert_eq!(again.file, store.file);
        assert_eq!(
            again.policy(Path::new("/home/me/project")),
            store.policy(Path::new("/home/me/project"))
        );
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("policy.json")]);
    }

    #[test]
    fn missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(&dir);
        assert_eq!(store.policy(Path::new("/w")), Policy::defaults());
        assert!(!dir.path().join("vmctl").exists());
    }

    #[test]
    fn malformed_file_is_reported_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        for text in [
            "{\"global\": {\"allow\": [\"a.com\"]",
            "{\"global\": {\"allow\": [\"a.*.com\"]}}",
            "{\"globl\": {}}",
            "{\"workspaces\": {\"relative\": {}}}",
        ] {
            std::fs::write(&path, text).unwrap();
            let err = PolicyStore::load(&path).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(&path.display().to_string()), "{message}");
            assert!(message.contains("fix it"), "{message}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        }
    }

    #[test]
    fn patterns_serialize_as_canonical_strings() {
        let rules: ScopeRules =
            serde_json::from_str(r#"{"allow": ["API.Example.com.:443"]}"#).unwrap();
        assert_eq!(rules.allow, vec![p("api.example.com:443")]);
        assert_eq!(
            serde_json::to_string(&rules).unwrap(),
            r#"{"allow":["api.example.com:443"],"deny":[]}"#
        );
    }
}
