//! The secrets the proxy injects, their store behind `vmctl secret`, the built-in
//! bindings and the placeholders the guest sees instead.
//!
//! The store is a JSON file chosen by the caller (vmctl uses
//! `$XDG_CONFIG_HOME/vmctl/secrets.json`), created 0600 in a 0700 directory and refused
//! when group or others can access it:
//!
//! ```json
//! {"secrets": {
//!   "anthropic": {"value": "sk-ant-..."},
//!   "internal": {"hosts": ["*.corp.example:443"], "header": "authorization: token {}", "value": "..."}}}
//! ```
//!
//! `hosts` and `header` are only stored when given (`--host`, `--header`); otherwise
//! the built-in binding of the name applies, so it follows this code:
//!
//! | name        | hosts                        | header                                               |
//! |-------------|------------------------------|------------------------------------------------------|
//! | `anthropic` | api.anthropic.com:443        | `x-api-key: V`, or `Authorization: Bearer V` for an OAuth token (`sk-ant-oat...`); the other one is removed |
//! | `openai`    | api.openai.com:443           | `Authorization: Bearer V`                            |
//! | `github`    | github.com, api.github.com (443) | `Authorization: Basic base64(x-access-token:V)` (git over HTTPS), but `Authorization: Bearer V` on api.github.com |
//! | other       | `--host` (required)          | `Authorization: Bearer V`                            |
//!
//! Values are held in [`zeroize::Zeroizing`] buffers and never printed; the
//! [`http::HeaderValue`] handed to the proxy is marked sensitive but is not zeroized.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use base64::Engine;
use http::{HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::policy::{write_atomically, Pattern};
use crate::rules::Injection;

/// The longest secret value accepted, in bytes.
pub const MAX_SECRET_LEN: usize = 16 * 1024;
/// The shortest credential `vmctl secret set` takes (the part after a value's last
/// space, `Bearer` and the like being no secret): the proxy redacts secrets from what
/// the guest reads, and shorter strings cannot be told from ordinary text.
pub const MIN_SECRET_LEN: usize = 8;

/// The value the guest sees in place of a secret (see [`placeholder_for`]).
pub const PLACEHOLDER: &str = "vmctl-placeholder";

/// The built-in secret names, which have default bindings (`Kind::of` tells them
/// apart; a test keeps the two in step).
pub const BUILTIN_NAMES: &[&str] = &["anthropic", "openai", "github"];

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the secret value: {0}")]
    Input(#[source] io::Error),
    #[error("the secret value is empty; pipe it on stdin, e.g. printf %s \"$TOKEN\" | vmctl secret set NAME")]
    Empty,
    #[error("the secret value is longer than {MAX_SECRET_LEN} bytes; no credential that goes in an HTTP header is this long")]
    TooLong,
    #[error("the secret value is {len} bytes long (its part after the last space, if it has one); values shorter than {MIN_SECRET_LEN} are refused, as the egress proxy could not keep them out of the responses the guest reads without mangling ordinary text")]
    TooShort { len: usize },
    #[error("the secret value {reason}; it must be printable ASCII to go in an HTTP header (pipe exactly one value, at most one trailing newline)")]
    InvalidValue { reason: String },
    #[error("{name:?} is not a valid secret name: {reason}; use {builtins} or a name of lower-case letters, digits, '-' and '_' (at most 64)", builtins = BUILTIN_NAMES.join(", "))]
    Name { name: String, reason: String },
    #[error("secret {name}: {source}")]
    Host {
        name: String,
        source: crate::policy::PolicyError,
    },
    #[error("{spec:?} is not a valid header: {reason}; write NAME (the secret as is) or 'NAME: TEMPLATE' with {{}} once, e.g. 'Authorization: token {{}}'")]
    Header { spec: String, reason: String },
    #[error("secret {name} is not a built-in one ({builtins}): say where it goes with at least one --host HOST", builtins = BUILTIN_NAMES.join(", "))]
    NoHosts { name: String },
    #[error("secret {name}: --host {host} would send it to every site under a domain where anyone can have one (a top-level, registry or hosting domain); name the API's host, or its own domain ('*.example.com')")]
    HostTooBroad { name: String, host: String },
    #[error("cannot read the secret file {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("the secret file {} is accessible by group or others (mode {mode:03o}); run 'chmod 600 {}'", .path.display(), .path.display())]
    Permissions { path: PathBuf, mode: u32 },
    #[error("the secret file {} belongs to uid {owner}, not to you (uid {me}); remove it and set the secrets again", .path.display())]
    Owner { path: PathBuf, owner: u32, me: u32 },
    #[error("the secret file {} is malformed ({reason}); fix it by hand, or move it away and set the secrets again with 'vmctl secret set'", .path.display())]
    Malformed { path: PathBuf, reason: String },
    #[error("cannot write the secret file {}: {source}", .path.display())]
    Write { path: PathBuf, source: io::Error },
}

/// A secret value: zeroed when dropped, never printed (`Debug` shows `<redacted>`,
/// there is no `Display`).
#[derive(Clone)]
pub struct SecretValue(Zeroizing<String>);

impl SecretValue {
    /// The value itself, for the proxy. Do not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether this is an Anthropic OAuth token (Claude subscription) rather than an
    /// API key.
    fn is_anthropic_oauth(&self) -> bool {
        self.0.starts_with("sk-ant-oat")
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Reads a secret value from `reader` (all of it): strips one trailing `\n` or
/// `\r\n` and refuses empty values, values over [`MAX_SECRET_LEN`] and anything that
/// cannot be an HTTP header value. The error never contains the value.
pub fn read_secret(mut reader: impl Read) -> Result<SecretValue, SecretError> {
    // One fixed buffer, never reallocated (a reallocation would leave a copy behind),
    // big enough for the longest value and its line break plus one byte to notice
    // longer input.
    let mut buf = Zeroizing::new(vec![0u8; MAX_SECRET_LEN + 3]);
    let mut len = 0;
    while len < buf.len() {
        match reader.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SecretError::Input(e)),
        }
    }
    if len == buf.len() {
        return Err(SecretError::TooLong);
    }
    let mut bytes = &buf[..len];
    if let Some(rest) = bytes.strip_suffix(b"\n") {
        bytes = rest.strip_suffix(b"\r").unwrap_or(rest);
    }
    check_value(bytes)?;
    let mut value = Zeroizing::new(String::with_capacity(bytes.len()));
    // Checked above: printable ASCII.
    value.extend(bytes.iter().map(|&b| char::from(b)));
    Ok(SecretValue(value))
}

/// Refuses a value whose credential (the part after its last space, if it has one)
/// is shorter than [`MIN_SECRET_LEN`]: what `vmctl secret set` takes.
pub fn check_redactable(value: &SecretValue) -> Result<(), SecretError> {
    let bytes = value.0.as_bytes();
    let credential = bytes.rsplit(|&b| b == b' ').next().unwrap_or(bytes);
    if credential.len() < MIN_SECRET_LEN {
        return Err(SecretError::TooShort {
            len: credential.len(),
        });
    }
    Ok(())
}

fn check_value(bytes: &[u8]) -> Result<(), SecretError> {
    let invalid = |reason: String| Err(SecretError::InvalidValue { reason });
    if bytes.is_empty() {
        return Err(SecretError::Empty);
    }
    if bytes.len() > MAX_SECRET_LEN {
        return Err(SecretError::TooLong);
    }
    if let Some(i) = bytes.iter().position(|&b| !(b' '..=b'~').contains(&b)) {
        let what = match bytes[i] {
            b'\n' | b'\r' => "a line break",
            b if b.is_ascii_control() => "a control character",
            _ => "a non-ASCII byte",
        };
        return invalid(format!("has {what} at byte {}", i + 1));
    }
    if bytes.first() == Some(&b' ') || bytes.last() == Some(&b' ') {
        return invalid("starts or ends with a space".into());
    }
    Ok(())
}

/// What `--header` says: the header name, and how the value is written in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSpec {
    name: HeaderName,
    /// The text before and after `{}`; none means the secret as is.
    template: Option<(String, String)>,
}

/// Headers a secret may not be injected into: they frame or route the request.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
    "proxy-authorization",
];

impl HeaderSpec {
    fn new(name: HeaderName, prefix: &str) -> HeaderSpec {
        HeaderSpec {
            name,
            template: Some((prefix.to_owned(), String::new())),
        }
    }

    /// The header's name (lower-case).
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// The header value for `value`, in a buffer zeroed on drop.
    fn render(&self, value: &SecretValue) -> Zeroizing<String> {
        let (prefix, suffix) = match &self.template {
            Some((prefix, suffix)) => (prefix.as_str(), suffix.as_str()),
            None => ("", ""),
        };
        let mut out = Zeroizing::new(String::with_capacity(
            prefix.len() + value.expose().len() + suffix.len(),
        ));
        out.push_str(prefix);
        out.push_str(value.expose());
        out.push_str(suffix);
        out
    }
}

impl FromStr for HeaderSpec {
    type Err = SecretError;

    fn from_str(spec: &str) -> Result<HeaderSpec, SecretError> {
        let error = |reason: &str| SecretError::Header {
            spec: spec.to_owned(),
            reason: reason.to_owned(),
        };
        let (name, template) = match spec.split_once(':') {
            Some((name, template)) => (name.trim(), Some(template.trim())),
            None => (spec.trim(), None),
        };
        if name.is_empty() {
            return Err(error("the header name is missing"));
        }
        let name = HeaderName::from_str(name).map_err(|_| {
            error("the header name may only hold letters, digits and -!#$%&'*+.^_`|~")
        })?;
        if FORBIDDEN_HEADERS.contains(&name.as_str()) {
            return Err(error("this header frames or routes the request"));
        }
        let template = match template {
            None => None,
            Some("") => {
                return Err(error(
                    "nothing follows ':'; give a template such as 'Bearer {}'",
                ))
            }
            Some(template) => {
                if template.matches("{}").count() != 1 {
                    return Err(error("the template must contain {} exactly once"));
                }
                if !template.bytes().all(|b| (b' '..=b'~').contains(&b)) {
                    return Err(error(
                        "the template may only hold printable ASCII characters",
                    ));
                }
                let (prefix, suffix) = template.split_once("{}").unwrap_or((template, ""));
                Some((prefix.to_owned(), suffix.to_owned()))
            }
        };
        Ok(HeaderSpec { name, template })
    }
}

impl fmt::Display for HeaderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.template {
            None => f.write_str(self.name.as_str()),
            Some((prefix, suffix)) => write!(f, "{}: {prefix}{{}}{suffix}", self.name),
        }
    }
}

/// The built-in names, and everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Anthropic,
    OpenAi,
    GitHub,
    Custom,
}

impl Kind {
    fn of(name: &str) -> Kind {
        match name {
            "anthropic" => Kind::Anthropic,
            "openai" => Kind::OpenAi,
            "github" => Kind::GitHub,
            _ => Kind::Custom,
        }
    }

    fn default_hosts(self) -> &'static [&'static str] {
        match self {
            Kind::Anthropic => &["api.anthropic.com:443"],
            Kind::OpenAi => &["api.openai.com:443"],
            Kind::GitHub => &["github.com:443", "api.github.com:443"],
            Kind::Custom => &[],
        }
    }

    /// The credential headers of the API, all but the injected one removed from
    /// requests so a placeholder sent in the other one does not confuse the server.
    fn credential_headers(self) -> &'static [&'static str] {
        match self {
            Kind::Anthropic => &["authorization", "x-api-key"],
            _ => &[],
        }
    }
}

fn check_name(name: &str) -> Result<(), SecretError> {
    let error = |reason: &str| SecretError::Name {
        name: name.to_owned(),
        reason: reason.to_owned(),
    };
    let first = name.bytes().next().ok_or_else(|| error("it is empty"))?;
    if name.len() > 64 {
        return Err(error("it is over 64 characters"));
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return Err(error("it must start with a lower-case letter or a digit"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        return Err(error(
            "it holds other characters than a-z, 0-9, '-' and '_'",
        ));
    }
    Ok(())
}

/// One stored secret.
#[derive(Debug, Clone)]
struct Entry {
    /// `--host`; empty for the built-in hosts.
    hosts: Vec<Pattern>,
    /// `--header`; none for the built-in header.
    header: Option<HeaderSpec>,
    value: SecretValue,
}

impl Entry {
    fn hosts(&self, kind: Kind) -> Vec<Pattern> {
        if !self.hosts.is_empty() {
            return self.hosts.clone();
        }
        kind.default_hosts()
            .iter()
            .map(|h| h.parse().expect("built-in hosts are valid patterns"))
            .collect()
    }

    /// The header for a request to `host` (which matched one of the hosts).
    fn header(&self, kind: Kind, host: &str) -> HeaderForm {
        if let Some(spec) = &self.header {
            return HeaderForm::Spec(spec.clone());
        }
        let bearer = || HeaderForm::Spec(HeaderSpec::new(http::header::AUTHORIZATION, "Bearer "));
        match kind {
            Kind::Anthropic if self.value.is_anthropic_oauth() => bearer(),
            Kind::Anthropic => HeaderForm::Spec(HeaderSpec {
                name: HeaderName::from_static("x-api-key"),
                template: None,
            }),
            Kind::GitHub if host != "api.github.com" => HeaderForm::GitBasic,
            Kind::OpenAi | Kind::GitHub | Kind::Custom => bearer(),
        }
    }

    fn summary(&self, name: &str) -> SecretSummary {
        let kind = Kind::of(name);
        let hosts = self.hosts(kind);
        // The header does not depend on the host but for github's, whose name is
        // the same on every host.
        let host = hosts.first().map(|h| h.to_string()).unwrap_or_default();
        SecretSummary {
            name: name.to_owned(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            header_name: self.header(kind, &host).name().as_str().to_owned(),
        }
    }
}

/// How the header value is built.
enum HeaderForm {
    Spec(HeaderSpec),
    /// `Authorization: Basic base64("x-access-token:" + value)`: what git sends to
    /// GitHub over HTTPS with a token.
    GitBasic,
}

impl HeaderForm {
    fn name(&self) -> &HeaderName {
        match self {
            HeaderForm::Spec(spec) => &spec.name,
            HeaderForm::GitBasic => &http::header::AUTHORIZATION,
        }
    }

    fn render(&self, value: &SecretValue) -> Zeroizing<String> {
        match self {
            HeaderForm::Spec(spec) => spec.render(value),
            HeaderForm::GitBasic => {
                const USER: &str = "x-access-token:";
                let mut credentials =
                    Zeroizing::new(String::with_capacity(USER.len() + value.expose().len()));
                credentials.push_str(USER);
                credentials.push_str(value.expose());
                let engine = &base64::engine::general_purpose::STANDARD;
                let mut out = Zeroizing::new(String::with_capacity(
                    "Basic ".len() + base64::encoded_len(credentials.len(), true).unwrap_or(0),
                ));
                out.push_str("Basic ");
                engine.encode_string(credentials.as_bytes(), &mut out);
                out
            }
        }
    }
}

/// What `vmctl secret ls` shows of a secret: never its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSummary {
    pub name: String,
    /// The canonical patterns it is sent to (`host:port`, `*.domain:port`).
    pub hosts: Vec<String>,
    /// The header it goes in (lower-case).
    pub header_name: String,
}

/// The secret file. Load it, change it, save it.
#[derive(Debug, Clone)]
pub struct SecretStore {
    path: PathBuf,
    /// By name: iteration in name order decides which secret wins a host.
    secrets: BTreeMap<String, Entry>,
}

impl SecretStore {
    /// Reads the store at `path`; a missing file is an empty store. Refuses a file
    /// that group or others may access, or that belongs to someone else.
    pub fn load(path: impl Into<PathBuf>) -> Result<SecretStore, SecretError> {
        let path = path.into();
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(SecretStore {
                    path,
                    secrets: BTreeMap::new(),
                })
            }
            Err(source) => return Err(SecretError::Read { path, source }),
        };
        let meta = match file.metadata() {
            Ok(meta) => meta,
            Err(source) => return Err(SecretError::Read { path, source }),
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(SecretError::Owner {
                path,
                owner: meta.uid(),
                me,
            });
        }
        if meta.mode() & 0o077 != 0 {
            return Err(SecretError::Permissions {
                path,
                mode: meta.mode() & 0o777,
            });
        }
        // Reserve enough up front so the buffer is never reallocated (which would
        // leave copies of the secrets behind).
        let capacity = usize::try_from(meta.len()).unwrap_or(0).saturating_add(1);
        let mut text = Zeroizing::new(Vec::with_capacity(capacity));
        if let Err(source) = file.read_to_end(&mut text) {
            return Err(SecretError::Read { path, source });
        }
        let secrets = match parse_file(&text) {
            Ok(secrets) => secrets,
            Err(reason) => return Err(SecretError::Malformed { path, reason }),
        };
        Ok(SecretStore { path, secrets })
    }

    /// The file this store was loaded from and saves to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sets (or replaces entirely) the secret `name`. `hosts` (`--host`: host,
    /// `host:port` or `*.domain`, port 443 when none is given) replaces the built-in
    /// hosts; `header` (`--header`: `Name` or `Name: template` with `{}` once) the
    /// built-in header. A name that is not built in needs at least one host.
    /// Returns what `vmctl secret ls` will show of it.
    pub fn set(
        &mut self,
        name: &str,
        value: SecretValue,
        hosts: Vec<String>,
        header: Option<String>,
    ) -> Result<SecretSummary, SecretError> {
        let (hosts, header) = check_destination(name, &hosts, header.as_deref())?;
        let entry = Entry {
            hosts,
            header,
            value,
        };
        let summary = entry.summary(name);
        self.secrets.insert(name.to_owned(), entry);
        Ok(summary)
    }

    /// Whether the secret `name` is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.secrets.contains_key(name)
    }

    /// Removes the secret `name`; false if there was none.
    pub fn remove(&mut self, name: &str) -> bool {
        self.secrets.remove(name).is_some()
    }

    /// Every secret, by name, without values.
    pub fn list(&self) -> Vec<SecretSummary> {
        self.secrets
            .iter()
            .map(|(name, entry)| entry.summary(name))
            .collect()
    }

    /// Writes the store atomically: a temporary file created 0600, renamed over the
    /// old one; the directory is created 0700 if needed.
    pub fn save(&self) -> Result<(), SecretError> {
        let text = serialize_file(&self.secrets).map_err(|e| SecretError::Write {
            path: self.path.clone(),
            source: io::Error::other(e),
        })?;
        write_atomically(&self.path, &text, 0o600).map_err(|source| SecretError::Write {
            path: self.path.clone(),
            source,
        })
    }

    /// The environment variables that make the agents' CLIs believe they are signed
    /// in, with placeholder values (never the secrets themselves): the proxy puts
    /// the real credential in their requests.
    pub fn placeholder_env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        for (name, entry) in &self.secrets {
            let vars: &[&str] = match Kind::of(name) {
                Kind::Anthropic if entry.value.is_anthropic_oauth() => &["CLAUDE_CODE_OAUTH_TOKEN"],
                Kind::Anthropic => &["ANTHROPIC_API_KEY"],
                // Codex reads the second in `codex exec` (newer releases), the first
                // elsewhere.
                Kind::OpenAi => &["OPENAI_API_KEY", "CODEX_API_KEY"],
                Kind::GitHub => &["GH_TOKEN", "GITHUB_TOKEN"],
                Kind::Custom => &[],
            };
            let placeholder = placeholder_for(&entry.value);
            env.extend(
                vars.iter()
                    .map(|var| ((*var).to_owned(), placeholder.to_owned())),
            );
        }
        env
    }

    /// The credential for a request to `host:port` (`host` lower-case, no brackets, no
    /// trailing dot). When several secrets are bound to it, the first by name wins.
    pub fn injection_for(&self, host: &str, port: u16) -> Option<Injection> {
        let (name, entry, kind) = self.secrets.iter().find_map(|(name, entry)| {
            let kind = Kind::of(name);
            entry
                .hosts(kind)
                .iter()
                .any(|p| p.matches(host, port))
                .then_some((name, entry, kind))
        })?;
        let form = entry.header(kind, host);
        let rendered = form.render(&entry.value);
        let mut value = match HeaderValue::from_str(&rendered) {
            Ok(value) => value,
            Err(_) => {
                // Values and templates are checked when set and loaded: not reached.
                tracing::warn!("secret {name}: its header value is invalid; not injected");
                return None;
            }
        };
        value.set_sensitive(true);
        let header = form.name().clone();
        let remove = kind
            .credential_headers()
            .iter()
            .map(|h| HeaderName::from_static(h))
            .filter(|h| *h != header)
            .collect();
        Some(Injection {
            secret: name.clone(),
            header,
            value,
            secret_value: entry.value.clone(),
            remove,
        })
    }
}

/// The starts that credentials of a kind all share, so that they say nothing of the
/// credential: what a response may hold of a secret without probing for it (see the
/// proxy's tripwire). The token formats of the built-in names (Anthropic's API, OAuth
/// and admin keys and OAuth refresh tokens; OpenAI's project, service-account, admin
/// and legacy keys; GitHub's personal, OAuth, user-to-server, server-to-server,
/// refresh and fine-grained tokens), matched whatever the secret's name, as a custom
/// secret may hold one of these too. What follows them is random, `-` and `_`
/// included (base64url), so no separator further on ends a public form.
const PUBLIC_PREFIXES: &[&str] = &[
    "sk-ant-api03-",
    "sk-ant-oat01-",
    "sk-ant-ort01-",
    "sk-ant-admin01-",
    "sk-proj-",
    "sk-svcacct-",
    "sk-admin-",
    "sk-None-",
    "sk-",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
];

/// The length of `value`'s public form: the longest of [`PUBLIC_PREFIXES`] it starts
/// with, or 0 (a secret of no known format is secret from its first byte).
pub(crate) fn public_form_len(value: &[u8]) -> usize {
    PUBLIC_PREFIXES
        .iter()
        .filter(|prefix| value.starts_with(prefix.as_bytes()))
        .map(|prefix| prefix.len())
        .max()
        .unwrap_or(0)
}

/// The placeholder the guest sees for `value`: [`PLACEHOLDER`], or a run of zeros if
/// the value is part of it. (A non-empty part of `PLACEHOLDER` has no '0', so it is
/// never part of the zeros.)
pub fn placeholder_for(value: &SecretValue) -> &'static str {
    if PLACEHOLDER.contains(value.expose()) {
        "0000000000000000"
    } else {
        PLACEHOLDER
    }
}

/// Checks what [`SecretStore::set`] is given besides the value (before anyone types
/// one): the name, where the secret goes and in which header.
pub fn check_destination(
    name: &str,
    hosts: &[String],
    header: Option<&str>,
) -> Result<(Vec<Pattern>, Option<HeaderSpec>), SecretError> {
    check_name(name)?;
    let hosts = parse_hosts(name, hosts)?;
    if hosts.is_empty() && Kind::of(name) == Kind::Custom {
        return Err(SecretError::NoHosts {
            name: name.to_owned(),
        });
    }
    if let Some(broad) = hosts.iter().find(|h| h.covers_a_public_suffix()) {
        return Err(SecretError::HostTooBroad {
            name: name.to_owned(),
            host: broad.to_string(),
        });
    }
    let header = header.map(HeaderSpec::from_str).transpose()?;
    Ok((hosts, header))
}

fn parse_hosts(name: &str, hosts: &[String]) -> Result<Vec<Pattern>, SecretError> {
    let mut patterns: Vec<Pattern> = Vec::with_capacity(hosts.len());
    for host in hosts {
        let pattern = host
            .parse::<Pattern>()
            .map_err(|source| SecretError::Host {
                name: name.to_owned(),
                source,
            })?
            .with_default_port(443);
        if !patterns.contains(&pattern) {
            patterns.push(pattern);
        }
    }
    Ok(patterns)
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretFile {
    secrets: BTreeMap<String, StoredEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredEntry {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    #[serde(with = "value_serde")]
    value: Zeroizing<String>,
}

/// (De)serializes a value straight from and into zeroed buffers.
mod value_serde {
    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};
    use zeroize::Zeroizing;

    pub fn serialize<S: Serializer>(value: &Zeroizing<String>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Zeroizing<String>, D::Error> {
        struct ValueVisitor;
        impl Visitor<'_> for ValueVisitor {
            type Value = Zeroizing<String>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Zeroizing::new(v.to_owned()))
            }
            fn visit_string<E: Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Zeroizing::new(v))
            }
        }
        d.deserialize_str(ValueVisitor)
    }
}

/// The secret file's shape, for the errors of a file that has another.
const LAYOUT: &str = "the file must be {\"secrets\": {\"NAME\": {\"value\": \"...\", \
     \"hosts\": [\"HOST\"], \"header\": \"NAME: TEMPLATE\"}}} (an empty store: \
     {\"secrets\": {}})";

/// Whether `text` is a JSON object without a `secrets` key (`{}`, say), for which
/// serde's position (the object's end) alone says little. Its values are skipped, not
/// kept.
fn lacks_secrets_key(text: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct TopLevel {
        secrets: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_slice::<TopLevel>(text).is_ok_and(|top| top.secrets.is_none())
}

/// Parses the file's text. Errors never quote the file (it holds secrets): serde's
/// messages can, so only their position is kept.
fn parse_file(text: &[u8]) -> Result<BTreeMap<String, Entry>, String> {
    let file: SecretFile = serde_json::from_slice(text).map_err(|e| {
        let at = format!("at line {} column {}", e.line(), e.column());
        match e.classify() {
            serde_json::error::Category::Data if lacks_secrets_key(text) => {
                format!("it has no top-level \"secrets\" key; {LAYOUT}")
            }
            serde_json::error::Category::Data => {
                format!("its content does not fit the layout {at}; {LAYOUT}")
            }
            serde_json::error::Category::Eof => format!("the JSON text ends too early, {at}"),
            _ => format!("invalid JSON, {at}"),
        }
    })?;
    let mut secrets = BTreeMap::new();
    for (name, stored) in file.secrets {
        let entry = (|| {
            check_name(&name)?;
            check_value(stored.value.as_bytes())?;
            let hosts = parse_hosts(&name, &stored.hosts)?;
            if hosts.is_empty() && Kind::of(&name) == Kind::Custom {
                return Err(SecretError::NoHosts { name: name.clone() });
            }
            let header = stored
                .header
                .as_deref()
                .map(HeaderSpec::from_str)
                .transpose()?;
            Ok(Entry {
                hosts,
                header,
                value: SecretValue(stored.value),
            })
        })()
        .map_err(|e: SecretError| format!("secret {name:?}: {e}"))?;
        secrets.insert(name, entry);
    }
    Ok(secrets)
}

/// The file's text, in a buffer reserved up front and zeroed on drop.
fn serialize_file(secrets: &BTreeMap<String, Entry>) -> serde_json::Result<Zeroizing<Vec<u8>>> {
    let file = SecretFile {
        secrets: secrets
            .iter()
            .map(|(name, entry)| {
                let stored = StoredEntry {
                    hosts: entry.hosts.iter().map(|h| h.to_string()).collect(),
                    header: entry.header.as_ref().map(|h| h.to_string()),
                    value: entry.value.0.clone(),
                };
                (name.clone(), stored)
            })
            .collect(),
    };
    // JSON at most doubles a printable ASCII value ('"' and '\' are escaped); pretty
    // printing adds little beyond the generous slack per entry.
    let capacity: usize = file
        .secrets
        .iter()
        .map(|(name, e)| {
            let hosts: usize = e.hosts.iter().map(|h| h.len() + 16).sum();
            let header = e.header.as_ref().map_or(0, |h| 2 * h.len());
            2 * e.value.len() + 2 * name.len() + hosts + header + 256
        })
        .sum::<usize>()
        + 256;
    let mut out = Zeroizing::new(Vec::with_capacity(capacity));
    serde_json::to_writer_pretty(&mut *out, &file)?;
    out.push(b'\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn secret(text: &str) -> SecretValue {
        read_secret(text.as_bytes()).unwrap()
    }

    /// The names the messages list are the ones with bindings of their own, and only
    /// those.
    #[test]
    fn the_builtin_names_are_the_built_in_kinds() {
        let kinds: Vec<Kind> = BUILTIN_NAMES.iter().map(|name| Kind::of(name)).collect();
        assert_eq!(kinds, [Kind::Anthropic, Kind::OpenAi, Kind::GitHub]);
        let no_hosts = SecretError::NoHosts { name: "x".into() }.to_string();
        assert!(
            no_hosts.contains(" (anthropic, openai, github): "),
            "{no_hosts}"
        );
        let name = SecretError::Name {
            name: "X".into(),
            reason: "r".into(),
        }
        .to_string();
        assert!(
            name.contains("; use anthropic, openai, github or a name "),
            "{name}"
        );
    }

    /// The public form is a known prefix, whatever separators the random part after
    /// it happens to hold; a secret of no known format has none.
    #[test]
    fn the_public_form_is_a_known_prefix_only() {
        for (value, public) in [
            ("sk-ant-api03-Qw3rTy8_Zx0Lm9Nb7Vc5-Xz1As2", "sk-ant-api03-"),
            ("sk-ant-oat01-a_b-c", "sk-ant-oat01-"),
            ("sk-proj-Ab_cd-Ef", "sk-proj-"),
            ("sk-Ab_cd-Ef", "sk-"),
            ("ghp_Ab_cd", "ghp_"),
            ("github_pat_11AB_cd", "github_pat_"),
            ("my-corp_token-1234", ""),
            ("Zx81Kq03 Lm77", ""),
        ] {
            assert_eq!(public_form_len(value.as_bytes()), public.len(), "{value}");
        }
    }

    fn store(dir: &tempfile::TempDir) -> SecretStore {
        SecretStore::load(dir.path().join("vmctl/secrets.json")).unwrap()
    }

    fn header_of(store: &SecretStore, host: &str) -> (String, String, String, Vec<String>) {
        let injection = store.injection_for(host, 443).expect("an injection");
        assert!(injection.value.is_sensitive());
        (
            injection.secret,
            injection.header.as_str().to_owned(),
            injection.value.to_str().unwrap().to_owned(),
            injection
                .remove
                .iter()
                .map(|h| h.as_str().to_owned())
                .collect(),
        )
    }

    #[test]
    fn read_secret_trims_one_line_break() {
        assert_eq!(secret("abc").expose(), "abc");
        assert_eq!(secret("abc\n").expose(), "abc");
        assert_eq!(secret("abc\r\n").expose(), "abc");
        assert_eq!(secret("a b").expose(), "a b");
        let max = "x".repeat(MAX_SECRET_LEN);
        assert_eq!(secret(&max).expose(), max);
        assert_eq!(secret(&format!("{max}\r\n")).expose(), max);
    }

    #[test]
    fn a_credential_too_short_to_redact_is_refused() {
        for short in ["1234567", "Bearer 1234567", "a b"] {
            let err = check_redactable(&secret(short)).unwrap_err();
            assert!(matches!(err, SecretError::TooShort { .. }), "{short}");
            assert!(!err.to_string().contains(short), "{err}");
        }
        for long in ["12345678", "Bearer 12345678", "sk-ant-api03-abcdefgh"] {
            check_redactable(&secret(long)).unwrap();
        }
    }

    #[test]
    fn read_secret_refuses_bad_values() {
        let err = |text: &[u8]| read_secret(text).unwrap_err();
        assert!(matches!(err(b""), SecretError::Empty));
        assert!(matches!(err(b"\n"), SecretError::Empty));
        assert!(matches!(err(b"\r\n"), SecretError::Empty));
        let long = "x".repeat(MAX_SECRET_LEN + 1);
        assert!(matches!(err(long.as_bytes()), SecretError::TooLong));
        let huge = vec![b'x'; 10 * MAX_SECRET_LEN];
        assert!(matches!(err(&huge), SecretError::TooLong));
        for (bad, why) in [
            (&b"abc\n\n"[..], "line break"),
            (b"ab\ncd", "line break"),
            (b"abc\r", "line break"),
            (b"a\tb", "control character"),
            (b"a\x00b", "control character"),
            ("sécret".as_bytes(), "non-ASCII"),
            (b" abc", "space"),
            (b"abc ", "space"),
        ] {
            let message = err(bad).to_string();
            assert!(message.contains(why), "{bad:?}: {message}");
        }
        // Errors never quote the value.
        let message = err(b"topsecret\x01").to_string();
        assert!(!message.contains("topsecret"), "{message}");
    }

    #[test]
    fn secret_value_debug_is_redacted() {
        let value = secret("hunter2");
        assert_eq!(format!("{value:?}"), "<redacted>");
        let mut store = SecretStore::load("/nonexistent/secrets.json").unwrap();
        store.set("openai", value, vec![], None).unwrap();
        assert!(!format!("{store:?}").contains("hunter2"));
        let injection = store.injection_for("api.openai.com", 443).unwrap();
        assert!(!format!("{injection:?}").contains("hunter2"));
    }

    #[test]
    fn anthropic_api_key_and_oauth_token() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store(&dir);
        store
            .set("anthropic", secret("sk-ant-api03-key"), vec![], None)
            .unwrap();
        assert_eq!(
            header_of(&store, "api.anthropic.com"),
            (
                "anthropic".into(),
                "x-api-key".into(),
                "sk-ant-api03-key".into(),
                vec!["authorization".into()]
            )
        );
        assert!(store.injection_for("api.anthropic.com", 80).is_none());
        assert!(store.injection_for("statsig.anthropic.com", 443).is_none());
        assert_eq!(
            store.placeholder_env(),
            vec![("ANTHROPIC_API_KEY".into(), PLACEHOLDER.into())]
        );

        store
            .set("anthropic", secret("sk-ant-oat01-token"), vec![], None)
            .unwrap();
        assert_eq!(
            header_of(&store, "api.anthropic.com"),
            (
                "anthropic".into(),
                "authorization".into(),
                "Bearer sk-ant-oat01-token".into(),
                vec!["x-api-key".into()]
            )
        );
        assert_eq!(
            store.placeholder_env(),
            vec![("CLAUDE_CODE_OAUTH_TOKEN".into(), PLACEHOLDER.into())]
        );
        assert_eq!(store.list()[0].header_name, "authorization");
    }

    #[test]
    fn openai_binding() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store(&dir);
        let summary = store
            .set("openai", secret("sk-proj-1"), vec![], None)
            .unwrap();
        assert_eq!(
            summary,
            SecretSummary {
                name: "openai".into(),
                hosts: vec!["api.openai.com:443".into()],
                header_name: "authorization".into()
            }
        );
        assert_eq!(
            header_of(&store, "api.openai.com"),
            (
                "openai".into(),
                "authorization".into(),
                "Bearer sk-proj-1".into(),
                vec![]
            )
        );
        assert_eq!(
            store.placeholder_env(),
            vec![
                ("OPENAI_API_KEY".into(), PLACEHOLDER.into()),
                ("CODEX_API_KEY".into(), PLACEHOLDER.into())
            ]
        );
    }

    #[test]
    fn github_basic_for_git_and_bearer_for_the_api() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store(&dir);
        store
            .set("github", secret("ghp_abc"), vec![], None)
            .unwrap();
        let (_, header, value, _) = header_of(&store, "github.com");
        assert_eq!(header, "authorization");
        // base64("x-access-token:ghp_abc")
        assert_eq!(value, "Basic eC1hY2Nlc3MtdG9rZW46Z2hwX2FiYw==");
        let (_, header, value, _) = header_of(&store, "api.github.com");
        assert_eq!(
            (header.as_str(), value.as_str()),
            ("authorization", "Bearer ghp_abc")
        );
        assert!(store.injection_for("codeload.github.com", 443).is_none());
        assert_eq!(
            store.placeholder_env(),
            vec![
                ("GH_TOKEN".into(), PLACEHOLDER.into()),
                ("GITHUB_TOKEN".into(), PLACEHOLDER.into())
            ]
        );
        assert_eq!(
            store.list()[0].hosts,
            vec!["github.com:443".to_owned(), "api.github.com:443".to_owned()]
        );
        // --host replaces the hosts (GitHub Enterprise), still in the git form.
        store
            .set(
                "github",
                secret("ghp_abc"),
                vec!["GHE.corp.example".into()],
                None,
            )
            .unwrap();
        assert!(store.injection_for("github.com", 443).is_none());
        let (_, _, value, _) = header_of(&store, "ghe.corp.example");
        assert!(value.starts_with("Basic "), "{value}");
    }

    #[test]
    fn custom_secrets_need_hosts_and_take_header_specs() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store(&dir);
        let err = store.set("corp", secret("v"), vec![], None).unwrap_err();
        assert!(err.to_string().contains("--host"), "{err}");
        store
            .set(
                "corp",
                secret("tok"),
                vec!["*.corp.example".into(), "api.x.io:8443".into()],
                None,
            )
            .unwrap();
        let (_, header, value, remove) = header_of(&store, "a.b.corp.example");
        assert_eq!(
            (header.as_str(), value.as_str(), remove.len()),
            ("authorization", "Bearer tok", 0)
        );
        let i = store.injection_for("api.x.io", 8443).unwrap();
        assert_eq!(i.value.to_str().unwrap(), "Bearer tok");
        assert!(store.injection_for("api.x.io", 443).is_none());
        assert!(store.injection_for("corp.example", 443).is_none());
        assert!(store.placeholder_env().is_empty());

        store
            .set(
                "corp",
                secret("tok"),
                vec!["api.x.io".into()],
                Some("Authorization: token {}".into()),
            )
            .unwrap();
        assert_eq!(header_of(&store, "api.x.io").2, "token tok");
        store
            .set(
                "corp",
                secret("tok"),
                vec!["api.x.io".into()],
                Some("X-Api-Key".into()),
            )
            .unwrap();
        let (_, header, value, _) = header_of(&store, "api.x.io");
        assert_eq!((header.as_str(), value.as_str()), ("x-api-key", "tok"));
        store
            .set(
                "corp",
                secret("tok"),
                vec!["api.x.io".into()],
                Some("X-Sig: k={};v=1".into()),
            )
            .unwrap();
        assert_eq!(header_of(&store, "api.x.io").2, "k=tok;v=1");
        assert_eq!(store.list()[0].header_name, "x-sig");

        // --header on a built-in replaces its header; anthropic still drops the other.
        store
            .set(
                "anthropic",
                secret("sk-ant-api-1"),
                vec![],
                Some("Authorization: Bearer {}".into()),
            )
            .unwrap();
        let (_, header, value, remove) = header_of(&store, "api.anthropic.com");
        assert_eq!(
            (header.as_str(), value.as_str(), remove),
            (
                "authorization",
                "Bearer sk-ant-api-1",
                vec!["x-api-key".to_owned()]
            )
        );
    }

    #[test]
    fn first_secret_by_name_wins_a_host() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = store(&dir);
        store
            .set("zzz", secret("z"), vec!["api.openai.com".into()], None)
            .unwrap();
        store.set("openai", secret("o"), vec![], None).unwrap();
        assert_eq!(header_of(&store, "api.openai.com").0, "openai");
        assert!(store.remove("openai"));
        assert!(!store.remove("openai"));
        assert_eq!(header_of(&store, "api.openai.com").0, "zzz");
    }

    #[test]
    fn bad_names_hosts_and_headers() {
        let mut store = SecretStore::load("/nonexistent/secrets.json").unwrap();
        for name in ["", "Anthropic", "-x", "a b", "a.b", &"a".repeat(65)] {
            let err = store
                .set(name, secret("v"), vec!["h.com".into()], None)
                .unwrap_err();
            assert!(matches!(err, SecretError::Name { .. }), "{name:?}: {err}");
        }
        store
            .set(&"a".repeat(64), secret("v"), vec!["h.com".into()], None)
            .unwrap();
        store
            .set("0_x-y", secret("v"), vec!["h.com".into()], None)
            .unwrap();
        let err = store
            .set("x", secret("v"), vec!["a.*.com".into()], None)
            .unwrap_err();
        assert!(err.to_string().contains("'*'"), "{err}");
        for (header, why) in [
            ("", "missing"),
            (": Bearer {}", "missing"),
            ("Bad Header", "letters"),
            ("X-Token:", "nothing follows"),
            ("X-Token: Bearer", "exactly once"),
            ("X-Token: {} {}", "exactly once"),
            ("X-Token: bé {}", "printable"),
            ("Host", "routes"),
            ("Content-Length: {}", "routes"),
        ] {
            let err = store
                .set("x", secret("v"), vec!["h.com".into()], Some(header.into()))
                .unwrap_err();
            assert!(
                matches!(err, SecretError::Header { .. }) && err.to_string().contains(why),
                "{header:?}: {err}"
            );
        }
    }

    #[test]
    fn placeholders_never_contain_the_value() {
        let mut store = SecretStore::load("/nonexistent/secrets.json").unwrap();
        for value in [
            "vmctl-placeholder",
            "placeholder",
            "l",
            "-",
            "0",
            "sk-ant-api",
        ] {
            store.set("openai", secret(value), vec![], None).unwrap();
            store.set("github", secret(value), vec![], None).unwrap();
            store.set("anthropic", secret(value), vec![], None).unwrap();
            let env = store.placeholder_env();
            assert_eq!(env.len(), 5);
            for (var, placeholder) in env {
                assert!(
                    !placeholder.contains(value),
                    "{var}={placeholder} contains {value:?}"
                );
            }
        }
    }

    #[test]
    fn round_trip_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmctl/secrets.json");
        let mut store = SecretStore::load(&path).unwrap();
        store
            .set("anthropic", secret("sk-ant-oat-x"), vec![], None)
            .unwrap();
        store
            .set(
                "corp",
                secret("a\"b\\c"),
                vec!["*.Corp.example".into()],
                Some("authorization: token {}".into()),
            )
            .unwrap();
        store.save().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);

        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"secrets": {
                "anthropic": {"value": "sk-ant-oat-x"},
                "corp": {"hosts": ["*.corp.example:443"], "header": "authorization: token {}", "value": "a\"b\\c"}
            }})
        );
        let again = SecretStore::load(&path).unwrap();
        assert_eq!(again.list(), store.list());
        assert_eq!(header_of(&again, "x.corp.example").2, "token a\"b\\c");
        assert_eq!(again.placeholder_env(), store.placeholder_env());

        // Saving again keeps the mode.
        again.save().unwrap();
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn refuses_a_file_others_can_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.json");
        let mut store = SecretStore::load(&path).unwrap();
        store.set("openai", secret("sk-1"), vec![], None).unwrap();
        store.save().unwrap();
        for bad in [0o644, 0o640, 0o604, 0o620] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(bad)).unwrap();
            let err = SecretStore::load(&path).unwrap_err();
            let message = err.to_string();
            assert!(
                message.contains(&format!("chmod 600 {}", path.display())),
                "{message}"
            );
            assert!(message.contains(&format!("{bad:03o}")), "{message}");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(SecretStore::load(&path).unwrap().list().len(), 1);
    }

    #[test]
    fn malformed_file_is_reported_without_its_content_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.json");
        for text in [
            r#"{"secrets": {"openai": "sk-leak-1"}}"#,
            r#"{"secrets": {"openai": {"value": "sk-leak-1"}"#,
            r#"{"secrets": {"openai": {"value": "sk-leak-1", "sk-leak-2": 1}}}"#,
            r#"{"secrets": {"corp": {"value": "sk-leak-1"}}}"#,
            r#"{"secrets": {"openai": {"value": "sk-leak-1 "}}}"#,
            r#"{"secrets": {"openai": {"value": "sk-leak-1", "hosts": ["a b"]}}}"#,
            r#"{"secrets": {"Openai": {"value": "sk-leak-1"}}}"#,
            r#"["sk-leak-1"]"#,
        ] {
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            let message = SecretStore::load(&path).unwrap_err().to_string();
            assert!(message.contains("malformed"), "{message}");
            assert!(message.contains(&path.display().to_string()), "{message}");
            assert!(!message.contains("sk-leak"), "{message}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        }
    }

    #[test]
    fn a_file_without_the_secrets_key_is_told_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.json");
        for text in ["{}", r#"{"openai": {"value": "sk-leak-1"}}"#] {
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            let message = SecretStore::load(&path).unwrap_err().to_string();
            assert!(
                message.contains("no top-level \"secrets\" key"),
                "{message}"
            );
            assert!(message.contains(r#"{"secrets": {}}"#), "{message}");
            assert!(!message.contains("sk-leak"), "{message}");
        }
    }
}
