//! Guest memory: a memfd mapped shared, so vhost-user backends can map the same pages.

use std::fs::File;
use std::os::fd::FromRawFd;

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
    // SAFETY: `name` is a valid NUL-terminated string and the flags are constants;
    // memfd_create has no other preconditions.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::CreateMemfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let backing_file = unsafe { File::from_raw_fd(fd) };
    backing_file
        .set_len(size)
        .map_err(|source| MemoryError::SizeMemfd { size, source })?;

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
}
