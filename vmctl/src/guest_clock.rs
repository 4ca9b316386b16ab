//! Keeps the clock of a VM nobody connects to in step with the host's.
//!
//! Every connection to the guest agent carries the host's time, from which the agent
//! steps the guest's clock when it is off (`guest_agent::clock`). An agent CLI that
//! works on its own for hours opens no such connection, and its VM would keep
//! whatever a host suspend, a host clock step or days of drift left it. So the
//! supervisor says Hello (with a `Health` request) every so often.

use std::path::PathBuf;
use std::time::Duration;

/// Overrides [`DEFAULT_INTERVAL`], in whole seconds; `0` turns the keeper off.
pub const INTERVAL_VAR: &str = "VMCTL_CLOCK_SYNC_SECS";
/// Often enough that drift of tens of ppm stays within the agent's 20 ms tolerance;
/// each costs the guest one vsock connection.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// A guest that does not answer within this is asked again at the next interval.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The interval [`INTERVAL_VAR`]'s value asks for: `None` when it turns the keeper off.
pub fn interval(value: Option<&str>) -> Result<Option<Duration>, String> {
    let Some(value) = value else {
        return Ok(Some(DEFAULT_INTERVAL));
    };
    match value.trim().parse::<u64>() {
        Ok(0) => Ok(None),
        Ok(secs) => Ok(Some(Duration::from_secs(secs))),
        Err(_) => Err(format!(
            "{INTERVAL_VAR}={value:?} is not a whole number of seconds (0 turns it off)"
        )),
    }
}

/// Starts the keeper's thread, per [`INTERVAL_VAR`], for the VM whose hybrid vsock
/// socket is `vsock`. It lives as long as the supervisor.
pub fn keep_in_step(vsock: PathBuf) {
    let every = match interval(std::env::var(INTERVAL_VAR).ok().as_deref()) {
        Ok(Some(every)) => every,
        Ok(None) => return,
        Err(e) => {
            vmm::to_stderr!(
                "vmctl: warning: {e}; using {} s",
                DEFAULT_INTERVAL.as_secs()
            );
            DEFAULT_INTERVAL
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            vmm::to_stderr!("vmctl: warning: the guest's clock will not be kept in step: {e}");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("vmctl-clock".into())
        .spawn(move || runtime.block_on(say_hello_every(vsock, every)));
    if let Err(e) = spawned {
        vmm::to_stderr!("vmctl: warning: the guest's clock will not be kept in step: {e}");
    }
}

async fn say_hello_every(vsock: PathBuf, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let hello = async {
            guest_agent::client::connect_hybrid(&vsock, crate::exec::AGENT_PORT)
                .await?
                .health()
                .await
        };
        // A guest still booting, or busy, is simply asked again next time.
        match tokio::time::timeout(ANSWER_TIMEOUT, hello).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::debug!("clock keeper: {e}"),
            Err(_) => tracing::debug!("clock keeper: no answer within {ANSWER_TIMEOUT:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_defaults_can_be_set_and_turned_off() {
        assert_eq!(interval(None), Ok(Some(DEFAULT_INTERVAL)));
        assert_eq!(interval(Some("5")), Ok(Some(Duration::from_secs(5))));
        assert_eq!(interval(Some("0")), Ok(None));
        let err = interval(Some("often")).unwrap_err();
        assert!(err.contains(INTERVAL_VAR) && err.contains("often"), "{err}");
    }
}
