//! `vmctl secret` and `vmctl policy`: thin commands over the egress stores.

use std::io::IsTerminal;
use std::path::PathBuf;

use egress::policy::{Pattern, PolicyStore, Scope};
use egress::secrets::{check_redactable, read_secret, SecretStore};

use crate::cli::{PolicyCommand, PolicyScope, SecretCommand};
use crate::network::guest_setup::EgressFiles;
use crate::state::VmDir;
use crate::terminal::print_out;

#[derive(Debug, thiserror::Error)]
pub enum EgressCommandError {
    #[error("no config directory for the egress policy and secrets (set HOME or VMCTL_CONFIG)")]
    NoConfigDir,
    #[error(transparent)]
    Secret(#[from] egress::secrets::SecretError),
    #[error(transparent)]
    Policy(#[from] egress::policy::PolicyError),
    #[error(transparent)]
    Log(#[from] egress::log::LogError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error("no secret named {0:?} ('vmctl secret ls' lists them)")]
    NoSuchSecret(String),
    #[error("no rule {patterns} of yours in {scope} ('vmctl policy ls' lists the rules in force; a default rule is overridden with 'vmctl policy deny', not removed)")]
    NoSuchRule { patterns: String, scope: String },
    #[error("cannot lock {}: {source}", .path.display())]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn files() -> Result<EgressFiles, EgressCommandError> {
    EgressFiles::locate().ok_or(EgressCommandError::NoConfigDir)
}

/// Held while a command reads, changes and writes the secrets or the policy, so two
/// at once cannot both write what each read and lose the other's change.
fn lock_stores(files: &EgressFiles) -> Result<std::fs::File, EgressCommandError> {
    let dir = files.secrets.parent().unwrap_or(std::path::Path::new("."));
    let path = dir.join(".egress.lock");
    let lock_error = |source| EgressCommandError::Lock {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(lock_error)?;
    crate::state::lock_file(&path).map_err(lock_error)
}

pub fn secret(command: SecretCommand) -> Result<u8, EgressCommandError> {
    let files = files()?;
    match command {
        SecretCommand::Set {
            name,
            hosts,
            header,
        } => {
            // Everything but the value is checked before anyone types it.
            egress::secrets::check_destination(&name, &hosts, header.as_deref())?;
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                vmm::to_stderr!(
                    "vmctl: type the value of {name:?} (not shown), then Enter and Ctrl-D:"
                );
            }
            let value = {
                let _quiet = crate::terminal::EchoOff::new(&stdin);
                read_secret(stdin.lock())?
            };
            check_redactable(&value)?;
            let _locked = lock_stores(&files)?;
            let mut store = SecretStore::load(files.secrets)?;
            let replaced = store.contains(&name);
            let summary = store.set(&name, value, hosts, header)?;
            store.save()?;
            vmm::to_stderr!(
                "vmctl: secret {} {}; it is sent as {} to {} (running VMs get its placeholder at their next exec)",
                summary.name,
                if replaced { "replaced" } else { "stored" },
                summary.header_name,
                summary.hosts.join(", ")
            );
        }
        SecretCommand::Ls => {
            let secrets = SecretStore::load(files.secrets)?.list();
            if secrets.is_empty() {
                vmm::to_stderr!("vmctl: no secrets ('vmctl secret set NAME' stores one)");
            } else {
                print_out(format_args!("{:<16} {:<16} HOSTS\n", "NAME", "HEADER"));
                for secret in secrets {
                    print_out(format_args!(
                        "{:<16} {:<16} {}\n",
                        secret.name,
                        secret.header_name,
                        secret.hosts.join(", ")
                    ));
                }
            }
        }
        SecretCommand::Rm { name } => {
            let _locked = lock_stores(&files)?;
            let mut store = SecretStore::load(files.secrets)?;
            if !store.remove(&name) {
                return Err(EgressCommandError::NoSuchSecret(name));
            }
            store.save()?;
            vmm::to_stderr!("vmctl: secret {name} removed");
        }
    }
    Ok(0)
}

pub fn policy(command: PolicyCommand) -> Result<u8, EgressCommandError> {
    let files = files()?;
    let _locked = match &command {
        PolicyCommand::Allow { .. } | PolicyCommand::Deny { .. } | PolicyCommand::Rm { .. } => {
            Some(lock_stores(&files)?)
        }
        PolicyCommand::Ls { .. } | PolicyCommand::Log { .. } => None,
    };
    // Loaded by the commands that use it only: `log` must work while policy.json is
    // malformed, which is when the proxy refuses everything and the log says why.
    let load = || PolicyStore::load(files.policy.clone());
    match command {
        PolicyCommand::Allow { patterns, scope } => {
            let mut store = load()?;
            let (scope, patterns) = (scope_of(&scope), parse(&patterns)?);
            store.allow(&scope, &patterns)?;
            store.save()?;
            vmm::to_stderr!("vmctl: allowed {} ({scope})", joined(&patterns));
        }
        PolicyCommand::Deny { patterns, scope } => {
            let mut store = load()?;
            let (scope, patterns) = (scope_of(&scope), parse(&patterns)?);
            store.deny(&scope, &patterns)?;
            store.save()?;
            vmm::to_stderr!("vmctl: denied {} ({scope})", joined(&patterns));
        }
        PolicyCommand::Rm { patterns, scope } => {
            let mut store = load()?;
            let (scope, patterns) = (scope_of(&scope), parse(&patterns)?);
            let removed = store.remove(&scope, &patterns);
            if removed == 0 {
                return Err(EgressCommandError::NoSuchRule {
                    patterns: joined(&patterns),
                    scope: scope.to_string(),
                });
            }
            store.save()?;
            vmm::to_stderr!("vmctl: removed {removed} rule(s) ({scope})");
        }
        PolicyCommand::Ls { workspace } => {
            let store = load()?;
            let workspace = canonical(workspace);
            print_out(format_args!(
                "# rules for {} (deny wins over allow)\n",
                workspace.display()
            ));
            for rule in store.policy(&workspace).rules() {
                print_out(format_args!("{rule}\n"));
            }
        }
        PolicyCommand::Log { workspace, lines } => {
            let (workspace, vm) = VmDir::lookup(&crate::workspace::of_vm(workspace))?;
            let entries = egress::log::read_recent(&vm.egress_log(), lines)?;
            if entries.is_empty() {
                vmm::to_stderr!(
                    "vmctl: the egress proxy of {}'s VM has logged nothing (yet)",
                    workspace.display()
                );
            }
            for entry in entries {
                print_out(format_args!(
                    "{}  {:<7} {:<5} {}:{}{}  {}{}\n",
                    utc_time(entry.time_unix_ms / 1000),
                    if entry.allowed { "allowed" } else { "refused" },
                    entry.method.as_deref().unwrap_or(entry.kind.as_str()),
                    entry.host,
                    entry.port,
                    entry
                        .secret
                        .as_deref()
                        .map(|s| format!(" +{s}"))
                        .unwrap_or_default(),
                    entry.rule,
                    entry.repeated.map(repeats_note).unwrap_or_default()
                ));
            }
        }
    }
    Ok(0)
}

fn parse(patterns: &[String]) -> Result<Vec<Pattern>, EgressCommandError> {
    Ok(patterns
        .iter()
        .map(|p| p.parse::<Pattern>())
        .collect::<Result<_, _>>()?)
}

fn joined(patterns: &[Pattern]) -> String {
    patterns
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn scope_of(scope: &PolicyScope) -> Scope {
    if scope.global {
        Scope::Global
    } else {
        Scope::Workspace(canonical(scope.workspace.clone()))
    }
}

/// The workspace as the VM sees it: canonical, like `vmctl up` records it.
fn canonical(dir: Option<PathBuf>) -> PathBuf {
    let dir = crate::workspace::of_vm(dir);
    dir.canonicalize().unwrap_or(dir)
}

/// What `policy log` adds to a line that counts the repeats of a refusal: the same
/// kind of refusal of the same destination, whose method and details (a Host header
/// the guest named) may differ from the line's.
fn repeats_note(times: u64) -> String {
    format!(" (refused {times} more times like this: same reason and destination, method and details aside)")
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of a Unix time.
fn utc_time(seconds: u64) -> String {
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(utc_time(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc_time(1_795_973_445), "2026-11-29 17:30:45");
    }
}
