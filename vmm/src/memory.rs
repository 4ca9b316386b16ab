//! Guest memory: a memfd mapped shared, so vhost-user backends can map the same pages.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

use vm_memory::{FileOffset, GuestAddress};

use crate::arch::x86_64::layout;

/// The guest memory type used throughout the VMM.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create the guest memory file (memfd_create): {0}")]
    CreateMemfd(std::io::Error),
    #[error("cannot size the guest memory file to {size} bytes: {source}")]
    SizeMemfd { size: u64, source: std::io::Error },
    #[error("cannot seal the size of the guest memory file (F_ADD_SEALS): {0}")]
    SealMemfd(std::io::Error),
    #[error("cannot map {size} bytes of guest memory: {reason} (lower --memory?)")]
    Map { size: u64, reason: String },
}

/// Guest memory together with the memfd that backs it.
pub struct GuestRam {
    pub memory: GuestMemoryMmap,
    /// Kept so later devices (vhost-user) can hand the same pages to a backend.
    pub backing_file: File,
}

/// Creates `size` bytes of guest RAM laid out around the MMIO gap.
pub fn create_guest_ram(size: u64) -> Result<GuestRam, MemoryError> {
    let name = c"vmm-guest-ram";
    // Sealable: the backends (virtiofsd) that map it must not be able to shrink it,
    // which would turn the VMM's next access to the cut pages into SIGBUS.
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: `name` is a valid NUL-terminated string and the flags are constants;
    // memfd_create has no other preconditions.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(MemoryError::CreateMemfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let backing_file = unsafe { File::from_raw_fd(fd) };
    backing_file
        .set_len(size)
        .map_err(|source| MemoryError::SizeMemfd { size, source })?;
    seal_size(&backing_file).map_err(MemoryError::SealMemfd)?;

    let mut file_start = 0u64;
    let mut regions = Vec::new();
    for (guest_start, len) in layout::ram_ranges(size) {
        let file = backing_file.try_clone().map_err(MemoryError::CreateMemfd)?;
        regions.push((
            GuestAddress(guest_start),
            len as usize,
            Some(FileOffset::new(file, file_start)),
        ));
        file_start += len;
    }
    let memory =
        GuestMemoryMmap::from_ranges_with_files(regions).map_err(|e| MemoryError::Map {
            size,
            reason: e.to_string(),
        })?;
    Ok(GuestRam {
        memory,
        backing_file,
    })
}

/// Fixes `file`'s size for good (F_SEAL_SHRINK, F_SEAL_GROW), then forbids changing
/// the seals (F_SEAL_SEAL): a backend that was handed the descriptor can no longer
/// truncate the guest's memory under the VMM. Writes stay allowed (the guest's RAM).
fn seal_size(file: &File) -> std::io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an integer argument and only changes the file's seals;
    // the descriptor is open for as long as `file` lives.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn memory_is_backed_by_the_memfd() {
        let ram = create_guest_ram(8 << 20).unwrap();
        assert_eq!(ram.backing_file.metadata().unwrap().len(), 8 << 20);
        assert_eq!(ram.memory.num_regions(), 1);
        ram.memory
            .write_obj(0xdead_beef_u32, GuestAddress(0x1000))
            .unwrap();
        let mut buf = [0u8; 4];
        use std::os::unix::fs::FileExt;
        ram.backing_file.read_exact_at(&mut buf, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xdead_beef);
    }

    /// Whoever holds the memfd (a vhost-user backend it is handed to) cannot change
    /// its size, nor lift the seals that forbid it; the guest's memory stays writable.
    #[test]
    fn the_memory_file_cannot_be_resized() {
        let ram = create_guest_ram(8 << 20).unwrap();
        for size in [4 << 20, 16 << 20, 0] {
            let error = ram.backing_file.set_len(size).unwrap_err();
            assert_eq!(
                error.raw_os_error(),
                Some(libc::EPERM),
                "to {size}: {error}"
            );
        }
        let fd = ram.backing_file.as_raw_fd();
        // SAFETY: F_GET_SEALS only reads the file's seals.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        let wanted = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        assert_eq!(seals & wanted, wanted);
        // A backend must not seal it further either (no more writes, for instance).
        // SAFETY: F_ADD_SEALS only changes the file's seals; it is refused here.
        let more_seals = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) };
        assert_eq!(
            (more_seals, std::io::Error::last_os_error().raw_os_error()),
            (-1, Some(libc::EPERM)),
            "the seals can still be changed"
        );
        use std::os::unix::fs::FileExt;
        ram.backing_file.write_all_at(&[1, 2, 3], 0x2000).unwrap();
        assert_eq!(ram.backing_file.metadata().unwrap().len(), 8 << 20);
    }
}
