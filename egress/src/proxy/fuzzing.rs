//! The response redaction alone, for the fuzz harness (`fuzz/src/redact.rs`): what
//! the proxy does to the body of a response to a request that carried a secret, one
//! chunk, pause or end at a time, as the harness chooses. Built only with the
//! `fuzzing` feature.

use std::sync::Arc;

use super::redact::{Redactor, Tripwire};

/// One response stream's redaction.
pub struct ResponseRedaction {
    redactor: Redactor,
    tripwire: Option<Arc<Tripwire>>,
}

impl ResponseRedaction {
    /// The redaction of a response to a request that carried `secret` in the header
    /// value `header_value`, watched for probes when `watched` (its count kept in
    /// memory only). None when there is nothing long enough to redact.
    pub fn new(header_value: &[u8], secret: &[u8], watched: bool) -> Option<Self> {
        let redactor = Redactor::for_secret(header_value, secret)?;
        let tripwire = watched.then(|| Arc::new(Tripwire::new("fuzzed", secret, None)));
        Some(Self {
            redactor: match &tripwire {
                Some(tripwire) => redactor.watched_by(tripwire.clone()),
                None => redactor,
            },
            tripwire,
        })
    }

    /// What goes to the guest of the stream so far, with `chunk` come.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.redactor.feed(chunk).to_vec()
    }

    /// What goes to the guest when the upstream pauses: the held-back bytes, as a
    /// stream that must not stall sends them.
    pub fn pause(&mut self) -> Vec<u8> {
        match self.redactor.holding() {
            true => self.redactor.flush_held().to_vec(),
            false => Vec::new(),
        }
    }

    /// What goes to the guest at the stream's end.
    pub fn finish(&mut self) -> Vec<u8> {
        self.redactor.finish().to_vec()
    }

    /// Whether the secret was withdrawn after probes: the proxy ends the stream then,
    /// before what the last call returned reaches the guest.
    pub fn withdrawn(&self) -> bool {
        self.redactor.withdrawn()
    }

    /// The probes of the secret counted so far (none when not watched).
    pub fn probes(&self) -> u32 {
        self.tripwire
            .as_ref()
            .map_or(0, |tripwire| tripwire.probes())
    }
}
