//! What the proxy asks of the policy and the secrets, as a trait so the proxy can be
//! tested with fixed rules and the stores without a proxy.

use http::{HeaderName, HeaderValue};

/// Whether a destination may be reached, and the rule that said so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The deciding rule as a person reads it, e.g. `deny *.example.com (global)`,
    /// `allow api.anthropic.com (default)` or `no allow rule matches`.
    pub rule: String,
}

/// A credential the proxy sets on requests to a bound destination.
#[derive(Clone)]
pub struct Injection {
    /// The secret's name (`anthropic`, `github`, ...), for logs; never its value.
    pub secret: String,
    /// The header the proxy sets, replacing whatever the client sent in it.
    pub header: HeaderName,
    /// The header's value, marked sensitive.
    pub value: HeaderValue,
    /// The secret itself, as stored: redacted from responses in any form, not only
    /// inside the header's (a template such as `session={}` puts text before it).
    pub secret_value: crate::secrets::SecretValue,
    /// Other headers the proxy removes (e.g. the placeholder credential a CLI sent
    /// in the other header its API accepts).
    pub remove: Vec<HeaderName>,
}

impl std::fmt::Debug for Injection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Injection")
            .field("secret", &self.secret)
            .field("header", &self.header)
            .field("value", &"<redacted>")
            .field("remove", &self.remove)
            .finish()
    }
}

/// The rules one sandbox's proxy follows. Implementations may re-read their files,
/// so a change made with `vmctl policy` or `vmctl secret` applies to new requests.
pub trait EgressRules: Send + Sync {
    /// May the guest reach `host:port`? `host` is lower-case, without brackets for
    /// IPv6 literals and without a trailing dot.
    fn decide(&self, host: &str, port: u16) -> Decision;
    /// The credential to set on requests to `host:port`, if a secret is bound to it.
    fn injection(&self, host: &str, port: u16) -> Option<Injection>;
}
