//! What no share may be, hold or (for some) lie inside: the home, the credential
//! directories in it and where variables move them, vmctl's own config, state and
//! cache, and the session's temporary and runtime directories.

use std::path::{Path, PathBuf};

use super::{Naming, Relation, Share, ShareError};

/// What to do instead of sharing a directory kept out of the guest.
pub(super) fn kept_out_remedy(instead: Option<&str>, naming: Naming) -> String {
    let another = naming.another_share();
    match instead {
        Some(instead) => {
            format!("{instead}. To share files, share a project's directory ({another})")
        }
        None => format!("share a project's directory instead ({another})"),
    }
}

/// A host directory the guest must never reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptOut {
    pub dir: PathBuf,
    pub what: &'static str,
    /// Whether a share inside it is refused too, not only one that is it or holds it.
    pub inside_too: bool,
    /// What gives the VM what it would be shared for, if anything does (a refusal
    /// says it).
    pub instead: Option<&'static str>,
}

impl KeptOut {
    /// `dir` kept out, resolved as far as it exists: a directory not made yet may still
    /// lie behind a link (`~/.config` into a dotfiles repository), where a guest could
    /// make it.
    fn resolved(dir: &Path, what: &'static str, inside_too: bool) -> KeptOut {
        KeptOut {
            dir: crate::state::resolve_existing_part(dir),
            what,
            inside_too,
            instead: None,
        }
    }
}

/// What no share may be or hold: the home directory (its `.ssh`, the agents' sign-ins,
/// cloud credentials: the host's secrets, which the VM must not have), the
/// directories in it that hold those credentials ([`CREDENTIAL_DIRS`], and where
/// `CLAUDE_CONFIG_DIR` and `CODEX_HOME` move the agents' sign-ins), and vmctl's own
/// config, state and cache directories, which no share may be inside either (the
/// secrets the egress proxy adds and the policy it enforces, which a guest that could
/// write them would rewrite; every VM's state, the egress CAs' keys among it; the
/// kernels, images and guest agent every VM boots).
pub fn kept_out_of_the_guest() -> Vec<KeptOut> {
    let (home, account_home) = homes();
    let config_file = crate::user_config::config_path();
    let config = config_file
        .as_deref()
        .and_then(Path::parent)
        .map(Path::to_path_buf);
    let account_config = account_home.as_ref().map(|home| home.join(".config/vmctl"));
    let homes: Vec<PathBuf> = home.into_iter().chain(account_home).collect();
    let configs: Vec<PathBuf> = config.into_iter().chain(account_config).collect();
    let egress = crate::network::guest_setup::EgressFiles::locate();
    let config_files: Vec<PathBuf> = config_file
        .into_iter()
        .chain(
            egress
                .into_iter()
                .flat_map(|files| [files.policy, files.secrets]),
        )
        .chain([crate::agent::env_file()])
        .collect();
    let mut kept_out = kept_out_from(
        &homes,
        &configs,
        &config_files,
        crate::state::state_dir(),
        crate::artifacts::cache_dir(),
    );
    kept_out.extend(sign_in_dirs_moved());
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    // A runtime directory that is not the user's alone (`XDG_RUNTIME_DIR=/tmp`) is a
    // temporary directory, kept out as such.
    let runtime: Vec<PathBuf> = [
        Some(PathBuf::from(format!("/run/user/{uid}"))),
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
    ]
    .into_iter()
    .flatten()
    .filter(|dir| dir.is_absolute() && crate::state::is_ours_alone(dir))
    .collect();
    kept_out.extend(session_dirs_kept_out(
        &[PathBuf::from("/tmp"), std::env::temp_dir()],
        &runtime,
        crate::state::private_tmp_dir(),
    ));
    kept_out
}

/// The directories every program of the user's session shares, which no share may be
/// or hold: the temporary directories (`tmp`: Kerberos tickets, other programs' files,
/// the jobs of `vmctl nested-exec` with their whole environment) and the user's
/// runtime directories (`runtime`, nothing inside them either: podman's registry
/// sign-in, keyring and agent sockets; but for one that holds a temporary directory,
/// `TMPDIR=/run/user/1000/tmp`, whose projects may be shared: then only its `vmctl`
/// and `containers` are kept out from inside). Both also hold vmctl's own sockets:
/// the daemon's, and the VMs' where a VM's own directory makes their paths too long
/// (`private`, nothing inside it either): a guest that could write there would point
/// the VMM's sockets elsewhere with a link (its own guest agent, another VM's, the
/// host's Docker socket).
fn session_dirs_kept_out(tmp: &[PathBuf], runtime: &[PathBuf], private: PathBuf) -> Vec<KeptOut> {
    const RUNTIME: &str =
        "your runtime directory (your session's sockets and credentials, vmctl's sockets)";
    let tmp: Vec<KeptOut> = tmp
        .iter()
        .map(|dir| {
            KeptOut::resolved(
                dir,
                "a temporary directory every program shares (their files and tickets, \
                 vmctl's sockets)",
                false,
            )
        })
        .collect();
    let runtime: Vec<KeptOut> = runtime
        .iter()
        .flat_map(|dir| {
            let whole = KeptOut::resolved(dir, RUNTIME, true);
            if !tmp.iter().any(|tmp| tmp.dir.starts_with(&whole.dir)) {
                return vec![whole];
            }
            let inside = ["vmctl", "containers"]
                .map(|inside| KeptOut::resolved(&dir.join(inside), RUNTIME, true));
            let whole = KeptOut {
                inside_too: false,
                ..whole
            };
            [whole].into_iter().chain(inside).collect()
        })
        .collect();
    let private = KeptOut::resolved(
        &private,
        "vmctl's own directory for sockets (the VMs' and the daemon's)",
        true,
    );
    // The first that a share meets is what it is told; the same directory twice
    // (TMPDIR unset, XDG_RUNTIME_DIR the usual one) would never be met.
    let mut kept_out: Vec<KeptOut> = Vec::new();
    for candidate in runtime.into_iter().chain(tmp).chain([private]) {
        if !kept_out.iter().any(|k| k.dir == candidate.dir) {
            kept_out.push(candidate);
        }
    }
    kept_out
}

/// `HOME`, and the account's own home from the password database. HOME may be unset,
/// or point elsewhere (a service's, a test's): what is in the account's own home is
/// kept from the guest all the same.
pub(super) fn homes() -> (Option<PathBuf>, Option<PathBuf>) {
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from);
    // SAFETY: getuid cannot fail.
    let account_home = crate::guest_account::password_entry(unsafe { libc::getuid() })
        .map(|(_, home)| PathBuf::from(home))
        .filter(|home| home.is_absolute() && home != Path::new("/"));
    (home, account_home)
}

/// A directory under a home that holds credentials (keys, tokens, sign-ins). Sharing
/// one would hand the VM the secrets vmctl otherwise keeps on the host (the agents'
/// and GitHub's tokens go to the egress proxy, never into the VM).
pub struct CredentialDir {
    /// Its path under the home.
    pub dir: &'static str,
    pub what: &'static str,
    /// Whether a directory inside it is kept out too: so it is where the secrets may
    /// lie anywhere below (`~/.ssh/work/id_ed25519`); the agents' directories and
    /// Cargo's keep theirs at the top (`~/.claude/.credentials.json`,
    /// `~/.codex/auth.json`, `~/.cargo/credentials.toml`) and hold what may be shared
    /// below (the agents' projects and worktrees, Cargo's download cache).
    pub inside_too: bool,
    /// What gives the VM what it is likely shared for, without the secret.
    pub instead: Option<&'static str>,
}

/// What gives git and gh in the VM their access to GitHub, for `~/.ssh` and
/// `~/.config/gh`.
const GITHUB_INSTEAD: &str = "for git push and gh in the VM, store a GitHub token with \
     `vmctl secret set github` (on stdin: `gh auth token | vmctl secret set github`): it \
     stays on the host, and the egress proxy adds it to the VM's requests to GitHub (git \
     over HTTPS; an SSH remote would need the key itself)";

pub const CREDENTIAL_DIRS: [CredentialDir; 20] = [
    CredentialDir {
        dir: ".ssh",
        what: "your SSH keys' directory",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".gnupg",
        what: "your GnuPG keys' directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".aws",
        what: "the AWS CLI's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".azure",
        what: "the Azure CLI's sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/gcloud",
        what: "the Google Cloud CLI's sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".kube",
        what: "kubectl's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".docker",
        what: "Docker's registry sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/gh",
        what: "the GitHub CLI's sign-in directory",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".password-store",
        what: "your pass password store",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".local/share/keyrings",
        what: "your desktop keyrings' directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/git",
        what: "git's own config directory (its credential store among it)",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".config/containers",
        what: "podman's config directory (its registry sign-in)",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".terraform.d",
        what: "Terraform's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/rclone",
        what: "rclone's config directory (its cloud storage tokens)",
        inside_too: true,
        instead: None,
    },
    // Their tops hold the repositories' passwords (`gradle.properties`, Maven's
    // `settings.xml` and `settings-security.xml`), which read-only would hand the guest
    // just the same; the caches below may be shared read-only (writable, they are
    // refused as the host's builds use them unchecked: [`BUILD_CACHE_DIRS`]).
    CredentialDir {
        dir: ".gradle",
        what: "Gradle's home (gradle.properties holds your repositories' passwords)",
        inside_too: false,
        instead: Some("share the dependency cache in it (`caches`) read-only instead"),
    },
    CredentialDir {
        dir: ".m2",
        what: "Maven's home (settings.xml holds your repositories' passwords)",
        inside_too: false,
        instead: Some("share the repository in it (`repository`) read-only instead"),
    },
    CredentialDir {
        dir: ".claude",
        what: "Claude Code's sign-in directory",
        inside_too: false,
        instead: Some(CLAUDE_INSTEAD),
    },
    CredentialDir {
        dir: ".codex",
        what: "Codex's sign-in directory",
        inside_too: false,
        instead: Some(CODEX_INSTEAD),
    },
    CredentialDir {
        dir: ".gemini",
        what: "the Gemini CLI's sign-in directory",
        inside_too: false,
        instead: None,
    },
    // Its top holds the crates.io token (`cargo publish`); below, the toolchain's
    // proxies and the download cache hold none, and are left shareable: refusing what
    // is inside would take the cache from a VM's builds to keep out no secret. (Its
    // `bin`, which the host runs, is refused writable: [`ProgramDir`].)
    CredentialDir {
        dir: ".cargo",
        what: "Cargo's home and crates.io token directory",
        inside_too: false,
        instead: Some(CARGO_INSTEAD),
    },
];

const CLAUDE_INSTEAD: &str = "Claude Code in the VM signs in through the egress proxy \
     instead: `vmctl secret set anthropic` (an API key or OAuth token, on stdin), which stays \
     on the host";

const CODEX_INSTEAD: &str = "Codex in the VM signs in through the egress proxy instead: \
     `vmctl secret set openai` (an API key, on stdin), which stays on the host";

const CARGO_INSTEAD: &str = "the directories inside it hold no token and may be shared \
     (its download cache read-only, say: `--mount ~/.cargo/registry:ro`)";

/// The variables that move a credential directory, the directory ([`CREDENTIAL_DIRS`])
/// they move, and what it is then: the variable is named, since unsetting it for
/// vmctl is what lifts a refusal of a project that keeps it (direnv, CI setups).
const CREDENTIAL_DIR_VARIABLES: [(&str, &str, &str); 10] = [
    (
        "CLAUDE_CONFIG_DIR",
        ".claude",
        "Claude Code's sign-in directory (CLAUDE_CONFIG_DIR)",
    ),
    (
        "CODEX_HOME",
        ".codex",
        "Codex's sign-in directory (CODEX_HOME)",
    ),
    (
        "CARGO_HOME",
        ".cargo",
        "Cargo's home and crates.io token directory (CARGO_HOME)",
    ),
    (
        "GNUPGHOME",
        ".gnupg",
        "your GnuPG keys' directory (GNUPGHOME)",
    ),
    (
        "DOCKER_CONFIG",
        ".docker",
        "Docker's registry sign-in directory (DOCKER_CONFIG)",
    ),
    (
        "GH_CONFIG_DIR",
        ".config/gh",
        "the GitHub CLI's sign-in directory (GH_CONFIG_DIR)",
    ),
    (
        "PASSWORD_STORE_DIR",
        ".password-store",
        "your pass password store (PASSWORD_STORE_DIR)",
    ),
    (
        "CLOUDSDK_CONFIG",
        ".config/gcloud",
        "the Google Cloud CLI's sign-in directory (CLOUDSDK_CONFIG)",
    ),
    (
        "GRADLE_USER_HOME",
        ".gradle",
        "Gradle's home (GRADLE_USER_HOME; gradle.properties holds your repositories' passwords)",
    ),
    (
        "TF_CLI_CONFIG_DIR",
        ".terraform.d",
        "Terraform's credentials directory (TF_CLI_CONFIG_DIR)",
    ),
];

/// Where [`CREDENTIAL_DIR_VARIABLES`] move the credential directories, and the files
/// `KUBECONFIG` names (kubectl's cluster credentials, which may lie in a project:
/// that project is then refused, as it holds them).
fn sign_in_dirs_moved() -> Vec<KeptOut> {
    sign_in_dirs_moved_by(set_variable)
}

/// The environment variable `name`'s value, unless it is unset or empty (as tools take
/// an empty one).
pub(super) fn set_variable(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

fn sign_in_dirs_moved_by(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Vec<KeptOut> {
    let kube_configs = var("KUBECONFIG")
        .map(|list| std::env::split_paths(&list).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|file| file.is_absolute())
        .map(|file| KeptOut::resolved(&file, "kubectl's credentials file (KUBECONFIG)", false));
    CREDENTIAL_DIR_VARIABLES
        .into_iter()
        .filter_map(|(variable, default, what)| {
            let dir = PathBuf::from(var(variable)?);
            let usual = CREDENTIAL_DIRS.iter().find(|c| c.dir == default)?;
            dir.is_absolute().then(|| KeptOut {
                instead: usual.instead,
                ..KeptOut::resolved(&dir, what, usual.inside_too)
            })
        })
        .chain(kube_configs)
        .collect()
}

fn kept_out_from(
    homes: &[PathBuf],
    configs: &[PathBuf],
    config_files: &[PathBuf],
    state: PathBuf,
    cache: Option<PathBuf>,
) -> Vec<KeptOut> {
    // The files vmctl reads may be links (GNU stow, chezmoi): the directory of each
    // link on the way is kept out as well, where a guest could change where it leads.
    let linked_config_files: Vec<KeptOut> = config_files
        .iter()
        .flat_map(|file| directories_of_links(file))
        .map(|dir| {
            KeptOut::resolved(
                &dir,
                "the directory a link to a file vmctl reads leads into",
                true,
            )
        })
        .collect();
    let credentials: Vec<KeptOut> = homes
        .iter()
        .flat_map(|home| {
            CREDENTIAL_DIRS.iter().map(|credentials| KeptOut {
                instead: credentials.instead,
                ..KeptOut::resolved(
                    &home.join(credentials.dir),
                    credentials.what,
                    credentials.inside_too,
                )
            })
        })
        .collect();
    let homes = homes
        .iter()
        .map(|dir| KeptOut::resolved(dir, "your home directory", false));
    let configs = configs.iter().map(|dir| {
        KeptOut::resolved(
            dir,
            "vmctl's config directory (secrets, egress policy)",
            true,
        )
    });
    let others = [
        Some(KeptOut::resolved(
            &state,
            "vmctl's state directory (every VM's state)",
            true,
        )),
        cache.map(|dir| {
            KeptOut::resolved(
                &dir,
                "vmctl's cache (the kernels, images and guest agent every VM boots)",
                true,
            )
        }),
    ]
    .into_iter()
    .flatten();
    // In this order: the first a share meets is what it is told.
    homes
        .chain(configs)
        .chain(credentials)
        .chain(others)
        .chain(linked_config_files)
        .collect()
}

/// The kernel's own bound on links in one lookup (MAXSYMLINKS): past it a lookup fails
/// (ELOOP), and so would what vmctl looks up, elsewhere.
pub(super) const MAX_LINKS: usize = 40;

/// Where each link from `file` on leads, one link at a time: the directories of the
/// links' targets (not `file`'s own), as far as they exist.
fn directories_of_links(file: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut link = file.to_path_buf();
    while dirs.len() < MAX_LINKS {
        let Ok(target) = std::fs::read_link(&link) else {
            break;
        };
        // A relative target is followed from the link's own directory.
        let Some(next) = link.parent().map(|parent| parent.join(target)) else {
            break;
        };
        let (Some(dir), Some(name)) = (next.parent(), next.file_name()) else {
            break;
        };
        let dir = crate::state::resolve_existing_part(dir);
        link = dir.join(name);
        dirs.push(dir);
    }
    dirs
}

/// Refuses `share` if it is, holds or (where that counts) lies inside a directory that
/// is kept out of the guest.
pub fn check_kept_out(share: &Share, kept_out: &[KeptOut]) -> Result<(), ShareError> {
    for kept in kept_out {
        let relation = if share.host == kept.dir {
            Relation::Is
        } else if kept.dir.starts_with(&share.host) {
            Relation::Holds
        } else if kept.inside_too && share.host.starts_with(&kept.dir) {
            Relation::IsInside
        } else {
            continue;
        };
        return Err(ShareError::KeptOut {
            host: share.host.clone(),
            relation,
            what: kept.what,
            kept_out: kept.dir.clone(),
            instead: kept.instead,
            naming: Naming::Options,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shares::tests::share;

    #[test]
    fn the_cache_every_vm_boots_from_is_kept_out_of_the_guest() {
        let cache = crate::artifacts::cache_dir().expect("HOME is set in tests");
        let cache = cache.canonicalize().unwrap_or(cache);
        let kept = kept_out_of_the_guest();
        let entry = kept.iter().find(|k| k.dir == cache).expect("the cache");
        assert!(entry.inside_too, "a share inside the cache is allowed");
    }

    /// vmctl's config directory is kept out where it will be, before it exists, and so
    /// is where its files lead when they are links (a dotfiles repository): a guest
    /// that could write them would widen every later VM's shares and its own egress.
    #[test]
    fn the_config_is_kept_out_behind_links_and_before_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let dotfiles = root.join("dotfiles");
        std::fs::create_dir_all(dotfiles.join(".config")).unwrap();
        std::fs::create_dir_all(dotfiles.join("vmctl")).unwrap();
        std::fs::write(dotfiles.join("vmctl/config.toml"), "").unwrap();
        std::os::unix::fs::symlink(dotfiles.join(".config"), root.join("xdg")).unwrap();
        let shared_dotfiles = share(dotfiles.to_str().unwrap(), "/d");
        let state = root.join("state");

        // ~/.config is a link into the dotfiles; ~/.config/vmctl is not made yet.
        let config_file = root.join("xdg/vmctl/config.toml");
        let kept = kept_out_from(
            &[],
            &[root.join("xdg/vmctl")],
            std::slice::from_ref(&config_file),
            state.clone(),
            None,
        );
        assert!(
            kept.iter().any(|k| k.dir == dotfiles.join(".config/vmctl")),
            "{kept:?}"
        );
        assert!(check_kept_out(&shared_dotfiles, &kept).is_err());

        // The config file is a link into the dotfiles (GNU stow).
        let config = root.join("cfg/vmctl");
        std::fs::create_dir_all(&config).unwrap();
        std::os::unix::fs::symlink(
            "../../dotfiles/vmctl/config.toml",
            config.join("config.toml"),
        )
        .unwrap();
        let kept = kept_out_from(
            &[],
            std::slice::from_ref(&config),
            &[config.join("config.toml")],
            state,
            None,
        );
        assert!(
            kept.iter().any(|k| k.dir == dotfiles.join("vmctl")),
            "{kept:?}"
        );
        assert!(check_kept_out(&shared_dotfiles, &kept).is_err());
        assert!(check_kept_out(&share(root.join("cfg").to_str().unwrap(), "/c"), &kept).is_err());
        assert!(check_kept_out(
            &share(root.join("elsewhere").to_str().unwrap(), "/e"),
            &kept
        )
        .is_ok());

        // A config file named elsewhere ($VMCTL_CONFIG), a link into a chain of links:
        // the directory of each link on the way is kept out, as a guest that could
        // write one could point the chain elsewhere.
        std::fs::create_dir_all(root.join("hop")).unwrap();
        std::os::unix::fs::symlink(
            dotfiles.join("vmctl/config.toml"),
            root.join("hop/work.toml"),
        )
        .unwrap();
        std::os::unix::fs::symlink(root.join("hop/work.toml"), root.join("work.toml")).unwrap();
        let named = root.join("work.toml");
        let kept = kept_out_from(
            &[],
            std::slice::from_ref(&root),
            &[named],
            root.join("state"),
            None,
        );
        for dir in [root.join("hop"), dotfiles.join("vmctl")] {
            assert!(kept.iter().any(|k| k.dir == dir), "{dir:?} in {kept:?}");
        }
    }

    #[test]
    fn no_share_is_holds_or_lies_in_what_is_kept_out_of_the_guest() {
        let kept_out = [
            KeptOut {
                dir: "/home/me".into(),
                what: "your home directory",
                inside_too: false,
                instead: None,
            },
            KeptOut {
                dir: "/home/me/.config/vmctl".into(),
                what: "vmctl's config directory",
                inside_too: true,
                instead: None,
            },
        ];
        let refusal = |host: &str| match check_kept_out(&share(host, "/x"), &kept_out) {
            Ok(()) => None,
            Err(ShareError::KeptOut {
                relation, kept_out, ..
            }) => Some(format!("{relation} {}", kept_out.display())),
            Err(other) => panic!("{other}"),
        };
        assert_eq!(refusal("/home/me/project"), None);
        assert_eq!(refusal("/home/me/.config/other"), None);
        assert_eq!(refusal("/home/me2"), None);
        assert_eq!(refusal("/srv"), None);
        assert_eq!(refusal("/home/me").as_deref(), Some("is /home/me"));
        assert_eq!(refusal("/home").as_deref(), Some("holds /home/me"));
        assert_eq!(
            refusal("/home/me/.config").as_deref(),
            Some("holds /home/me/.config/vmctl")
        );
        assert_eq!(
            refusal("/home/me/.config/vmctl/sub").as_deref(),
            Some("is inside /home/me/.config/vmctl")
        );
        let message = check_kept_out(&share("/home/me", "/home/me"), &kept_out)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with(
                "/home/me cannot be shared with the guest: it is your home directory \
                 /home/me, which must stay out of the VM"
            ),
            "{message}"
        );
    }

    /// What is kept out of the guest for a user whose home is `home`, with vmctl's own
    /// config, state and cache elsewhere.
    fn kept_out_of_home(home: &Path) -> Vec<KeptOut> {
        kept_out_from(
            &[home.to_path_buf()],
            &[],
            &[],
            PathBuf::from("/nonexistent-state"),
            None,
        )
    }

    /// The session's shared directories: none may be shared or held by a share, and
    /// nothing inside the runtime directory or vmctl's socket directory; a project
    /// inside /tmp may. (Review: `cd /tmp && vmctl run` gave the guest vmctl's
    /// relocated socket directories, where a link made the VMM connect the guest to
    /// its own agent or the host's Docker socket.)
    #[test]
    fn the_sessions_temporary_and_runtime_directories_are_kept_out() {
        let kept_out = session_dirs_kept_out(
            &["/nonexistent/tmp".into(), "/nonexistent/tmp".into()],
            &["/nonexistent/run/user/1000".into()],
            "/nonexistent/tmp/vmctl-1000".into(),
        );
        assert_eq!(kept_out.len(), 3, "the same directory is kept out once");
        let refusal = |host: &str| match check_kept_out(&share(host, "/x"), &kept_out) {
            Ok(()) => None,
            Err(error @ ShareError::KeptOut { .. }) => Some(error.to_string()),
            Err(other) => panic!("{other}"),
        };
        assert_eq!(refusal("/nonexistent/tmp/project"), None);
        assert_eq!(refusal("/nonexistent/srv"), None);
        for (host, says) in [
            (
                "/nonexistent/tmp",
                "a temporary directory every program shares",
            ),
            ("/nonexistent", "your runtime directory"),
            ("/nonexistent/run/user", "your runtime directory"),
            (
                "/nonexistent/run/user/1000/containers",
                "your runtime directory",
            ),
            (
                "/nonexistent/tmp/vmctl-1000",
                "vmctl's own directory for sockets",
            ),
            (
                "/nonexistent/tmp/vmctl-1000/vm-1234/vsock",
                "vmctl's own directory for sockets",
            ),
        ] {
            let refusal = refusal(host).unwrap_or_else(|| panic!("{host} was shared"));
            assert!(refusal.contains(says), "{host}: {refusal}");
        }
    }

    /// A runtime directory that holds the temporary one (`TMPDIR=/run/user/1000/tmp`,
    /// or `TMPDIR=$XDG_RUNTIME_DIR`) leaves the projects there shareable; vmctl's own
    /// sockets and podman's sign-in in it stay out. (Review: every share in the
    /// temporary directory was refused as the runtime directory.)
    #[test]
    fn a_runtime_directory_that_holds_the_temporary_one_leaves_its_projects_shareable() {
        for tmp in [
            "/nonexistent/run/user/1000/tmp",
            "/nonexistent/run/user/1000",
        ] {
            let kept_out = session_dirs_kept_out(
                &["/nonexistent/tmp".into(), tmp.into()],
                &["/nonexistent/run/user/1000".into()],
                "/nonexistent/tmp/vmctl-1000".into(),
            );
            let refused = |host: &str| check_kept_out(&share(host, "/x"), &kept_out).is_err();
            assert!(!refused(&format!("{tmp}/project")), "{tmp}");
            assert!(!refused("/nonexistent/tmp/project"), "{tmp}");
            for host in [
                "/nonexistent/run/user/1000",
                "/nonexistent/run/user/1000/vmctl",
                "/nonexistent/run/user/1000/containers/auth",
                "/nonexistent/tmp",
                tmp,
            ] {
                assert!(refused(host), "{tmp}: {host} was shared");
            }
        }
    }

    /// The credential directories in a home are kept out, and anything inside them;
    /// the home's other directories are not.
    #[test]
    fn credential_directories_are_kept_out_of_the_guest() {
        let home = PathBuf::from("/nonexistent-home/me");
        let kept_out = kept_out_of_home(&home);
        let refusal = |host: &str| {
            check_kept_out(&share(host, "/x"), &kept_out)
                .err()
                .map(|e| e.to_string())
        };
        for (secret, inside_too) in [
            (".ssh", true),
            (".aws", true),
            (".gnupg", true),
            (".config/gcloud", true),
            (".config/gh", true),
            (".docker", true),
            (".kube", true),
            (".config/git", true),
            (".config/containers", true),
            (".terraform.d", true),
            (".config/rclone", true),
            // Their passwords are at the top; the caches below may be shared read-only.
            (".gradle", false),
            (".m2", false),
            // The agents' sign-in is at the top; their worktrees below may be shared.
            (".claude", false),
            (".codex", false),
            // So is Cargo's token; its download cache below may be shared.
            (".cargo", false),
        ] {
            let dir = home.join(secret);
            let message = refusal(dir.to_str().unwrap()).unwrap_or_default();
            assert!(
                message.contains("it is ") && message.contains("must stay out of the VM"),
                "{secret}: {message:?}"
            );
            let inside = refusal(dir.join("sub").to_str().unwrap());
            assert_eq!(
                inside.as_deref().is_some_and(|m| m.contains("is inside")),
                inside_too,
                "{secret}: {inside:?}"
            );
        }
        assert!(refusal("/nonexistent-home/me/.claude")
            .unwrap()
            .contains("Claude Code's sign-in directory"));
        assert_eq!(refusal("/nonexistent-home/me/project"), None);
        assert_eq!(refusal("/nonexistent-home/me/.sshfs"), None);
    }

    /// Where the tools' variables move their credentials is kept out as their usual
    /// directory is, and so is each file KUBECONFIG names (with what holds it: a
    /// project that keeps one). Relative values move nothing.
    #[test]
    fn credentials_moved_by_variables_are_kept_out() {
        let kept_out = sign_in_dirs_moved_by(|name| {
            match name {
                "GNUPGHOME" => Some("/nonexistent/keys/gpg"),
                "DOCKER_CONFIG" => Some("relative/docker"),
                "KUBECONFIG" => {
                    Some("/nonexistent/project/kubeconfig:relative:/nonexistent/k8s/admin.conf")
                }
                "GRADLE_USER_HOME" => Some("/nonexistent/gradle"),
                _ => None,
            }
            .map(Into::into)
        });
        let refusal = |host: &str| {
            check_kept_out(&share(host, "/x"), &kept_out)
                .err()
                .map(|e| e.to_string())
        };
        for (host, says) in [
            ("/nonexistent/keys/gpg", "GnuPG keys' directory (GNUPGHOME)"),
            ("/nonexistent/keys/gpg/private-keys-v1.d", "(GNUPGHOME)"),
            (
                "/nonexistent/project",
                "kubectl's credentials file (KUBECONFIG)",
            ),
            (
                "/nonexistent/k8s",
                "kubectl's credentials file (KUBECONFIG)",
            ),
            ("/nonexistent/gradle", "Gradle's home (GRADLE_USER_HOME"),
        ] {
            let refusal = refusal(host).unwrap_or_else(|| panic!("{host} was shared"));
            assert!(refusal.contains(says), "{host}: {refusal}");
        }
        assert_eq!(refusal("/nonexistent/gradle/caches"), None);
        assert_eq!(refusal("/nonexistent/elsewhere"), None);
        assert_eq!(
            kept_out.len(),
            4,
            "{:?}",
            kept_out.iter().map(|k| &k.dir).collect::<Vec<_>>()
        );
    }

    /// A refusal of a directory shared for a sign-in names what gives the VM that
    /// sign-in without its secret: a GitHub token the proxy adds for `~/.ssh` and
    /// `~/.config/gh`, the agents' secrets for theirs; the others say to share a
    /// project.
    #[test]
    fn credential_refusals_name_what_to_do_instead() {
        let home = PathBuf::from("/nonexistent-home/me");
        let kept_out = kept_out_of_home(&home);
        let refusal = |dir: &str| {
            check_kept_out(&share(home.join(dir).to_str().unwrap(), "/x"), &kept_out).unwrap_err()
        };
        for (dir, instead) in [
            (".ssh", "vmctl secret set github"),
            (".ssh/work", "vmctl secret set github"),
            (".config/gh", "vmctl secret set github"),
            (".claude", "vmctl secret set anthropic"),
            (".codex", "vmctl secret set openai"),
            (
                ".cargo",
                "directories inside it hold no token and may be shared",
            ),
            (".aws", "share a project's directory instead"),
        ] {
            let error = refusal(dir);
            for message in [error.to_string(), error.for_agent().to_string()] {
                assert!(message.contains(instead), "{dir}: {message}");
                assert!(message.contains("share a project's directory"), "{message}");
            }
        }
    }
}
