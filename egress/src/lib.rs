//! The host side of a sandbox's network: the egress proxy every outbound request of
//! the guest goes through (over the guest agent and vsock), the network policy it
//! enforces, the secrets it injects (the guest only ever sees placeholders) and the
//! sandbox's own CA for the destinations whose TLS it must terminate.
//!
//! - [`rules`]: the seam between the proxy and the stores: [`rules::EgressRules`].
//! - [`policy`]: allow/deny patterns, their store, the default allow list.
//! - [`secrets`]: the secret store, built-in bindings, placeholders.
//! - [`ca`]: the per-sandbox CA and the leaf certificates it mints.
//! - [`proxy`]: the HTTP proxy (CONNECT and plain HTTP) itself.
//! - [`file_rules`]: [`rules::EgressRules`] over the policy and secret files.
//! - [`log`]: the decision log behind `vmctl policy log`.

pub mod ca;
pub mod file_rules;
pub mod log;
pub mod policy;
pub mod proxy;
pub mod rules;
pub mod secrets;
