//! Identity-mapping page tables for the 64-bit entry.
//!
//! The 64-bit boot protocol wants the kernel, the zero page and the command line
//! identity-mapped. One PML4 entry -> one PDPT entry -> one page directory of 512
//! 2 MiB pages maps the first 1 GiB, which covers all of them; the kernel builds its
//! own page tables right after entry.

use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::layout::{PDE_START, PDPTE_START, PML4_START};
use crate::memory::GuestMemoryMmap;

/// Entries per table (4 KiB / 8 bytes).
pub const ENTRIES_PER_TABLE: usize = 512;
/// Present.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Writable.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// Page size: in a page-directory entry, maps a 2 MiB page.
pub const PTE_PAGE_SIZE: u64 = 1 << 7;
/// Size of a page mapped by a page-directory entry with `PTE_PAGE_SIZE`.
pub const LARGE_PAGE_SIZE: u64 = 2 << 20;
/// How much of guest-physical memory the boot tables identity-map.
pub const IDENTITY_MAPPED_SIZE: u64 = ENTRIES_PER_TABLE as u64 * LARGE_PAGE_SIZE;

// The three tables are 4 KiB each and must not overlap.
const _: () = assert!(PML4_START + 0x1000 <= PDPTE_START && PDPTE_START + 0x1000 <= PDE_START);

type Table = [u64; ENTRIES_PER_TABLE];

#[derive(Debug, thiserror::Error)]
pub enum PagingError {
    #[error("cannot write the {table} page table at guest address {addr:#x}: {source}")]
    Write {
        table: &'static str,
        addr: u64,
        source: GuestMemoryError,
    },
}

/// The PML4: entry 0 points at the PDPT.
pub fn pml4_table() -> Table {
    let mut table = [0; ENTRIES_PER_TABLE];
    table[0] = PDPTE_START | PTE_PRESENT | PTE_WRITABLE;
    table
}

/// The PDPT: entry 0 points at the page directory.
pub fn pdpt_table() -> Table {
    let mut table = [0; ENTRIES_PER_TABLE];
    table[0] = PDE_START | PTE_PRESENT | PTE_WRITABLE;
    table
}

/// The page directory: entry i maps the 2 MiB page at i * 2 MiB onto itself.
pub fn pd_table() -> Table {
    let mut table = [0; ENTRIES_PER_TABLE];
    for (i, entry) in table.iter_mut().enumerate() {
        *entry = (i as u64 * LARGE_PAGE_SIZE) | PTE_PRESENT | PTE_WRITABLE | PTE_PAGE_SIZE;
    }
    table
}

fn write_table(
    mem: &GuestMemoryMmap,
    table: &Table,
    addr: u64,
    name: &'static str,
) -> Result<(), PagingError> {
    let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_le_bytes()).collect();
    mem.write_slice(&bytes, GuestAddress(addr))
        .map_err(|source| PagingError::Write {
            table: name,
            addr,
            source,
        })
}

/// Writes the PML4, PDPT and page directory (whole tables, so stale entries cannot
/// survive) and returns the value for CR3.
pub fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<u64, PagingError> {
    write_table(mem, &pml4_table(), PML4_START, "PML4")?;
    write_table(mem, &pdpt_table(), PDPTE_START, "PDPT")?;
    write_table(mem, &pd_table(), PDE_START, "page directory")?;
    Ok(PML4_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_entry(mem: &GuestMemoryMmap, table: u64, index: u64) -> u64 {
        mem.read_obj(GuestAddress(table + index * 8)).unwrap()
    }

    #[test]
    fn tables_are_page_aligned_and_distinct() {
        for t in [PML4_START, PDPTE_START, PDE_START] {
            assert_eq!(t % 0x1000, 0);
        }
    }

    #[test]
    fn writes_identity_map_of_first_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        // Garbage that must be overwritten.
        mem.write_slice(&[0xaa; 0x3000], GuestAddress(PML4_START))
            .unwrap();
        let cr3 = write_identity_page_tables(&mem).unwrap();
        assert_eq!(cr3, PML4_START);

        assert_eq!(read_entry(&mem, PML4_START, 0), PDPTE_START | 0x3);
        assert_eq!(read_entry(&mem, PDPTE_START, 0), PDE_START | 0x3);
        for i in 1..512 {
            assert_eq!(read_entry(&mem, PML4_START, i), 0);
            assert_eq!(read_entry(&mem, PDPTE_START, i), 0);
        }
        for i in 0..512 {
            assert_eq!(read_entry(&mem, PDE_START, i), (i << 21) | 0x83);
        }
        assert_eq!(read_entry(&mem, PDE_START, 511) & !0xfff, 0x3fe0_0000);
        assert_eq!(IDENTITY_MAPPED_SIZE, 1 << 30);
    }

    #[test]
    fn error_names_the_table_and_address() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0xa000)]).unwrap();
        let err = write_identity_page_tables(&mem).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("PDPT") && msg.contains("0xa000"), "{msg}");
    }
}
