//! A VM's network, host side: everything the supervisor serves besides the VMM.
//!
//! - [`services`]: connections the guest opens (the egress proxy, loopback relays).
//! - [`published`]: host ports published to guest loopback ports.
//! - [`control`]: the supervisor's control socket, through which `vmctl` configures
//!   the guest's network, relays and published ports of a running VM.
//! - [`guest_setup`]: what the guest is told: proxy variables, CA, placeholders.

pub mod control;
pub mod guest_setup;
pub mod published;
pub mod services;

/// Paseo's daemon port, relayed into every VM so its MCP URLs work unchanged.
pub const PASEO_PORT: u16 = 6767;

/// The next connection to `listener`. A failed accept (out of descriptors, say) is
/// logged and tried again after a pause, never the end of the service: every
/// connection to come would be refused.
pub async fn accept_again_and_again(
    listener: &tokio::net::UnixListener,
    what: &str,
) -> tokio::net::UnixStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => return stream,
            Err(e) => {
                tracing::warn!("accepting {what}: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}
