//! Connecting to this user's own Unix sockets only. A VM's control socket and the
//! daemon's may sit where another local user could have created them first (under
//! /tmp when the state or runtime directory is unusable); what vmctl says on them
//! (publish a port, stop a VM) must reach this user's vmctl and nobody else.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Connects to `path` if a process of this user (the effective uid) serves it.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    let stream = UnixStream::connect(path)?;
    if let Some(uid) = guest_agent::client::foreign_peer(&stream)? {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "it is served by another user (uid {uid}), not by this user's vmctl; someone \
                 else may have planted it: remove it, or see who made it"
            ),
        ));
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_of_this_user_is_connected_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("own.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let stream = connect(&path).unwrap();
        assert_eq!(guest_agent::client::foreign_peer(&stream).unwrap(), None);
        assert!(connect(&dir.path().join("missing.sock")).is_err());
    }
}
