//! The boot GDT and IDT.
//!
//! The vCPU enters the kernel already in 64-bit mode, so it needs a GDT with a
//! long-mode code segment and a flat data segment (plus a TSS descriptor for TR). The
//! IDT is a single zero entry: interrupts are disabled at entry and the kernel installs
//! its own IDT before enabling them.

use kvm_bindings::kvm_segment;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::layout::{BOOT_GDT_START, BOOT_IDT_START};
use crate::memory::GuestMemoryMmap;

/// Access byte + flags nibble of the 64-bit code segment: present, DPL 0, code
/// execute/read accessed; granularity 4 KiB, long mode (L=1, D=0).
pub const CODE_FLAGS: u16 = 0xa09b;
/// Flat data segment: present, DPL 0, data read/write accessed; 4 KiB granularity,
/// 32-bit default operand size (B=1).
pub const DATA_FLAGS: u16 = 0xc093;
/// 64-bit TSS (busy): present, system segment type 0xb; 4 KiB granularity.
pub const TSS_FLAGS: u16 = 0x808b;

/// Selector indices of the boot GDT.
pub const CODE_INDEX: u16 = 1;
pub const DATA_INDEX: u16 = 2;
pub const TSS_INDEX: u16 = 3;

/// The boot GDT: null, code, data, TSS descriptors, each 4 GiB flat.
pub const BOOT_GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(CODE_FLAGS, 0, 0xfffff),
    gdt_entry(DATA_FLAGS, 0, 0xfffff),
    gdt_entry(TSS_FLAGS, 0, 0xfffff),
];

/// `limit` of the GDTR for [`BOOT_GDT`] (its size in bytes minus one).
pub const BOOT_GDT_LIMIT: u16 = (std::mem::size_of::<[u64; 4]>() - 1) as u16;
/// The boot IDT is a single zero 8-byte entry.
pub const BOOT_IDT_LIMIT: u16 = (std::mem::size_of::<u64>() - 1) as u16;

// The GDT must end before the IDT starts.
const _: () = assert!(BOOT_GDT_START + (BOOT_GDT_LIMIT as u64) < BOOT_IDT_START);

#[derive(Debug, thiserror::Error)]
pub enum GdtError {
    #[error("cannot write the boot GDT at guest address {addr:#x}: {source}")]
    WriteGdt { addr: u64, source: GuestMemoryError },
    #[error("cannot write the boot IDT at guest address {addr:#x}: {source}")]
    WriteIdt { addr: u64, source: GuestMemoryError },
}

/// Encodes a segment descriptor. `flags` holds the access byte in bits 7:0 and the
/// G/DB/L/AVL nibble in bits 15:12 (bits 11:8 are where `limit[19:16]` goes and are
/// ignored); `limit` is 20 bits.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = base as u64;
    let limit = limit as u64;
    let flags = (flags as u64) & 0xf0ff;
    ((base & 0xff00_0000) << 32)
        | (flags << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
}

fn entry_base(entry: u64) -> u64 {
    ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff)
}

/// The segment limit in bytes, i.e. scaled to 4 KiB pages when G is set, as KVM
/// expects it.
fn entry_limit(entry: u64) -> u32 {
    let raw = (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32;
    if entry_g(entry) == 1 {
        (raw << 12) | 0xfff
    } else {
        raw
    }
}

fn entry_bit(entry: u64, bit: u32) -> u8 {
    ((entry >> bit) & 1) as u8
}

fn entry_g(entry: u64) -> u8 {
    entry_bit(entry, 55)
}

/// Decodes GDT entry `index` of a table into the segment KVM loads for it.
pub fn kvm_segment_from_gdt(entry: u64, index: u16) -> kvm_segment {
    let present = entry_bit(entry, 47);
    kvm_segment {
        base: entry_base(entry),
        limit: entry_limit(entry),
        selector: index * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: entry_bit(entry, 54),
        s: entry_bit(entry, 44),
        l: entry_bit(entry, 53),
        g: entry_g(entry),
        avl: entry_bit(entry, 52),
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// The code segment (CS) of the boot GDT.
pub fn code_segment() -> kvm_segment {
    kvm_segment_from_gdt(BOOT_GDT[CODE_INDEX as usize], CODE_INDEX)
}

/// The data segment (DS, ES, FS, GS, SS) of the boot GDT.
pub fn data_segment() -> kvm_segment {
    kvm_segment_from_gdt(BOOT_GDT[DATA_INDEX as usize], DATA_INDEX)
}

/// The task register segment of the boot GDT.
pub fn tss_segment() -> kvm_segment {
    kvm_segment_from_gdt(BOOT_GDT[TSS_INDEX as usize], TSS_INDEX)
}

/// Writes [`BOOT_GDT`] at `BOOT_GDT_START` and a single zero IDT entry at
/// `BOOT_IDT_START`.
pub fn write_gdt_and_idt(mem: &GuestMemoryMmap) -> Result<(), GdtError> {
    for (i, entry) in BOOT_GDT.iter().enumerate() {
        let addr = BOOT_GDT_START + (i * std::mem::size_of::<u64>()) as u64;
        mem.write_obj(*entry, GuestAddress(addr))
            .map_err(|source| GdtError::WriteGdt { addr, source })?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(|source| GdtError::WriteIdt {
            addr: BOOT_IDT_START,
            source,
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_well_known_descriptors() {
        // The flat descriptors every 64-bit boot loader uses.
        assert_eq!(gdt_entry(CODE_FLAGS, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(DATA_FLAGS, 0, 0xfffff), 0x00cf_9300_0000_ffff);
        assert_eq!(gdt_entry(TSS_FLAGS, 0, 0xfffff), 0x008f_8b00_0000_ffff);
        assert_eq!(gdt_entry(0, 0, 0), 0);
    }

    #[test]
    fn base_and_limit_round_trip() {
        let entry = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let seg = kvm_segment_from_gdt(entry, 5);
        assert_eq!(seg.base, 0x1234_5678);
        // G is clear: the limit is byte-granular.
        assert_eq!(seg.g, 0);
        assert_eq!(seg.limit, 0xabcde);
        assert_eq!(seg.selector, 40);
    }

    #[test]
    fn code_segment_is_long_mode() {
        let cs = code_segment();
        assert_eq!(cs.selector, 0x08);
        assert_eq!(cs.base, 0);
        assert_eq!(cs.limit, 0xffff_ffff);
        assert_eq!(cs.type_, 0xb);
        assert_eq!(cs.present, 1);
        assert_eq!(cs.dpl, 0);
        assert_eq!(cs.s, 1);
        assert_eq!(cs.l, 1);
        assert_eq!(cs.db, 0);
        assert_eq!(cs.g, 1);
        assert_eq!(cs.unusable, 0);
    }

    #[test]
    fn data_and_tss_segments() {
        let ds = data_segment();
        assert_eq!(ds.selector, 0x10);
        assert_eq!(ds.type_, 0x3);
        assert_eq!(ds.s, 1);
        assert_eq!(ds.db, 1);
        assert_eq!(ds.l, 0);
        assert_eq!(ds.limit, 0xffff_ffff);

        let tr = tss_segment();
        assert_eq!(tr.selector, 0x18);
        assert_eq!(tr.type_, 0xb);
        assert_eq!(tr.s, 0);
        assert_eq!(tr.present, 1);
    }

    #[test]
    fn null_segment_is_unusable() {
        let null = kvm_segment_from_gdt(BOOT_GDT[0], 0);
        assert_eq!(null.present, 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn writes_gdt_and_idt() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        mem.write_obj(0xffff_ffff_ffff_ffffu64, GuestAddress(BOOT_IDT_START))
            .unwrap();
        write_gdt_and_idt(&mem).unwrap();
        for (i, expected) in BOOT_GDT.iter().enumerate() {
            let got: u64 = mem
                .read_obj(GuestAddress(BOOT_GDT_START + 8 * i as u64))
                .unwrap();
            assert_eq!(got, *expected);
        }
        let idt: u64 = mem.read_obj(GuestAddress(BOOT_IDT_START)).unwrap();
        assert_eq!(idt, 0);
    }

    #[test]
    fn write_fails_without_low_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 0x1000)]).unwrap();
        let err = write_gdt_and_idt(&mem).unwrap_err();
        assert!(err.to_string().contains("0x500"), "{err}");
    }
}
