//! Dropping the host pages behind a range of guest memory.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::devices::virtio::guest_range_ok;
use crate::memory::GuestMemoryMmap;

/// The host's page size on x86_64: what madvise(2) works in.
const PAGE_SIZE: u64 = 0x1000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiscardError {
    #[error("guest range {addr:#x}+{len:#x} is not all guest RAM; none of its pages were dropped")]
    OutOfRange { addr: u64, len: u64 },
    #[error("cannot drop the host pages of guest range {addr:#x}+{len:#x} (madvise): {reason}")]
    Madvise { addr: u64, len: u64, reason: String },
}

/// Gives the host back the pages behind `addr..addr+len`; the guest reads zeros there
/// afterwards. Only whole pages inside the range are dropped, so a range that is not
/// page-aligned keeps the bytes around it. Guest memory backed by a file (the memfd
/// that vhost-user backends share) has its pages removed from the file, for every
/// process that maps it (MADV_REMOVE); anonymous memory (tests) loses this mapping's
/// pages (MADV_DONTNEED).
pub fn discard_guest_range(
    memory: &GuestMemoryMmap,
    addr: GuestAddress,
    len: u64,
) -> Result<(), DiscardError> {
    let out_of_range = || DiscardError::OutOfRange { addr: addr.0, len };
    let end = addr.0.checked_add(len).ok_or_else(out_of_range)?;
    let whole_len = usize::try_from(len).map_err(|_| out_of_range())?;
    if !guest_range_ok(memory, addr, whole_len) {
        return Err(out_of_range());
    }
    let mut cursor = addr.0;
    while cursor < end {
        let (region, offset) = memory
            .to_region_addr(GuestAddress(cursor))
            .ok_or_else(out_of_range)?;
        let in_region = (region.len() - offset.0).min(end - cursor);
        let host = region
            .get_host_address(offset)
            .map_err(|_| out_of_range())? as u64;
        let advice = if region.file_offset().is_some() {
            libc::MADV_REMOVE
        } else {
            libc::MADV_DONTNEED
        };
        let first = host.next_multiple_of(PAGE_SIZE);
        let last = (host + in_region) & !(PAGE_SIZE - 1);
        if last > first {
            // SAFETY: `first..last` lies inside one region's mapping (checked above),
            // which the GuestMemoryMmap keeps mapped for as long as `memory` lives.
            // Dropping its pages only changes what the guest reads there (zeros); the
            // VMM reads and writes guest memory with volatile accesses through
            // vm-memory and holds no Rust reference into it.
            let result = unsafe {
                libc::madvise(first as *mut libc::c_void, (last - first) as usize, advice)
            };
            if result != 0 {
                return Err(DiscardError::Madvise {
                    addr: addr.0,
                    len,
                    reason: std::io::Error::last_os_error().to_string(),
                });
            }
        }
        cursor += in_region;
    }
    Ok(())
}
