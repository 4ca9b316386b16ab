//! Connecting to this user's own Unix sockets only. A VM's control socket and the
//! daemon's may sit where another local user could have created them first (under
//! /tmp when the state or runtime directory is unusable); what vmctl says on them
//! (publish a port, stop a VM) must reach this user's vmctl and nobody else.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Connects to `path` if a process of this user (the effective uid) serves it.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    let stream = UnixStream::connect(path)?;
    let uid = peer_uid(&stream)?;
    // SAFETY: geteuid cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    if uid != me {
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

/// The uid of the process at the other end (as it was when it listened).
fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    // SAFETY: ucred is plain data; all zeroes is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and writable, `len` holds the size of `cred`,
    // and the descriptor is the stream's, open for this call.
    let done = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
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
        // SAFETY: geteuid touches no memory.
        assert_eq!(peer_uid(&stream).unwrap(), unsafe { libc::geteuid() });
        assert!(connect(&dir.path().join("missing.sock")).is_err());
    }
}
