//! What the guest is told about its network: where the proxy is, which CA to trust,
//! and the placeholder credentials the CLIs look for.

use std::path::PathBuf;

use guest_agent::protocol::{EGRESS_PROXY_PORT, GUEST_CA_BUNDLE, GUEST_NODE_PRELOAD};

/// Where the egress policy and secrets live: beside the user's config file.
pub struct EgressFiles {
    pub policy: PathBuf,
    pub secrets: PathBuf,
}

impl EgressFiles {
    pub fn locate() -> Option<EgressFiles> {
        let dir = crate::user_config::config_path()?.parent()?.to_path_buf();
        Some(EgressFiles {
            policy: dir.join("policy.json"),
            secrets: dir.join("secrets.json"),
        })
    }
}

/// Says on stderr which of the egress files the proxy cannot use (malformed, not
/// private, unreadable), read as the proxy reads them: the proxy then refuses every
/// request, and tells only its log and the guest's 403s why.
pub fn warn_of_unusable_egress_files() {
    if let Some(files) = EgressFiles::locate() {
        for problem in unusable_egress_files(&files) {
            vmm::to_stderr!(
                "vmctl: warning: {problem}; until it is fixed the VM's egress proxy \
                 refuses every request"
            );
        }
    }
}

/// What is wrong with each of `files` the proxy could not use.
fn unusable_egress_files(files: &EgressFiles) -> Vec<String> {
    let policy = egress::policy::PolicyStore::load(&files.policy).err();
    let secrets = egress::secrets::SecretStore::load(&files.secrets).err();
    [
        policy.map(|e| e.to_string()),
        secrets.map(|e| e.to_string()),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Every variable the guest's commands get: the proxy (both spellings, since tools
/// disagree), the CA for the runtimes that do not read the system bundle, and
/// `placeholders` (fake credentials, so the CLIs believe they are signed in).
pub fn guest_env(placeholders: Vec<(String, String)>) -> Vec<(String, String)> {
    let proxy = format!("http://127.0.0.1:{EGRESS_PROXY_PORT}");
    let no_proxy = "localhost,127.0.0.1,::1";
    let mut env: Vec<(String, String)> = [
        ("HTTP_PROXY", proxy.as_str()),
        ("http_proxy", proxy.as_str()),
        ("HTTPS_PROXY", proxy.as_str()),
        ("https_proxy", proxy.as_str()),
        ("NO_PROXY", no_proxy),
        ("no_proxy", no_proxy),
        ("NODE_USE_ENV_PROXY", "1"),
        // The whole bundle, not the egress CA alone: Node has roots of its own, which
        // lack what the host trusts besides (a TLS-inspecting company proxy's CA).
        ("NODE_EXTRA_CA_CERTS", GUEST_CA_BUNDLE),
        ("SSL_CERT_FILE", GUEST_CA_BUNDLE),
        ("REQUESTS_CA_BUNDLE", GUEST_CA_BUNDLE),
        ("GIT_SSL_CAINFO", GUEST_CA_BUNDLE),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    env.push((
        "NODE_OPTIONS".into(),
        format!("--require={GUEST_NODE_PRELOAD}"),
    ));
    env.extend(placeholders);
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_variables_in_both_cases_and_placeholders_last() {
        let env = guest_env(vec![("OPENAI_API_KEY".into(), "vmctl-placeholder".into())]);
        let get = |k: &str| {
            env.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("HTTPS_PROXY"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("https_proxy"), get("HTTPS_PROXY"));
        assert_eq!(get("NO_PROXY"), Some("localhost,127.0.0.1,::1"));
        assert_eq!(get("NODE_EXTRA_CA_CERTS"), Some(GUEST_CA_BUNDLE));
        assert_eq!(env.last().map(|(k, _)| k.as_str()), Some("OPENAI_API_KEY"));
    }

    #[test]
    fn egress_files_the_proxy_cannot_use_are_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let files = EgressFiles {
            policy: dir.path().join("policy.json"),
            secrets: dir.path().join("secrets.json"),
        };
        assert!(
            unusable_egress_files(&files).is_empty(),
            "missing files are fine"
        );
        std::fs::write(&files.policy, "{\"rules\": [").unwrap();
        std::fs::write(&files.secrets, "{}").unwrap();
        std::fs::set_permissions(&files.secrets, PermissionsExt::from_mode(0o600)).unwrap();
        let problems = unusable_egress_files(&files);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("policy.json"), "{problems:?}");
        assert!(problems[1].contains("secrets.json"), "{problems:?}");
        assert!(
            problems[1].contains("no top-level \"secrets\" key"),
            "{problems:?}"
        );
    }
}
