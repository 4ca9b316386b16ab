//! The Intel MultiProcessor Specification 1.4 table, which tells the guest how many
//! CPUs there are, where the IOAPIC is and how the legacy IRQs are wired (without
//! ACPI, this is how Linux finds the application processors).
//!
//! Layout at `EBDA_START`, where the kernel scans for it: the 16-byte floating
//! pointer, immediately followed by the configuration table (header, then one entry
//! per processor, the ISA bus, the IOAPIC, its 24 pins and the two LINT pins). With
//! more than 37 CPUs the table runs on past the EBDA into the legacy VGA/BIOS hole:
//! the kernel finds the floating pointer in the EBDA's first KiB and maps the table
//! wherever it points, and the e820 map keeps both areas out of the guest's RAM.
//! Every multi-byte field is little-endian; the table is serialised byte by byte.

use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::layout::{APIC_START, EBDA_START, HIMEM_START, IOAPIC_START};
use crate::memory::GuestMemoryMmap;

/// The table must end below 1 MiB, where the guest's RAM resumes (and the kernel is
/// loaded); nothing else lives between the EBDA and there.
pub const MPTABLE_LIMIT: u64 = HIMEM_START;

const MPF_SIZE: usize = 16;
const HEADER_SIZE: usize = 44;
const CPU_ENTRY_SIZE: usize = 20;
const BUS_ENTRY_SIZE: usize = 8;
const IOAPIC_ENTRY_SIZE: usize = 8;
const INTSRC_ENTRY_SIZE: usize = 8;
const LINTSRC_ENTRY_SIZE: usize = 8;

/// IOAPIC pins, each wired to the ISA IRQ of the same number.
pub const NUM_IOAPIC_PINS: u8 = 24;
const NUM_LOCAL_INTERRUPTS: usize = 2;

/// Bytes of everything except the processor entries.
const FIXED_SIZE: usize = MPF_SIZE
    + HEADER_SIZE
    + BUS_ENTRY_SIZE
    + IOAPIC_ENTRY_SIZE
    + NUM_IOAPIC_PINS as usize * INTSRC_ENTRY_SIZE
    + NUM_LOCAL_INTERRUPTS * LINTSRC_ENTRY_SIZE;

/// Most CPUs whose table fits between `EBDA_START` and `MPTABLE_LIMIT`, capped at
/// 254 (APIC IDs are 8 bits, 0xff is broadcast, and the IOAPIC takes the ID after the
/// last CPU).
pub const MAX_CPUS: u8 = {
    let fit = ((MPTABLE_LIMIT - EBDA_START) as usize - FIXED_SIZE) / CPU_ENTRY_SIZE;
    if fit > 254 {
        254
    } else {
        fit as u8
    }
};

const _: () = assert!(MAX_CPUS >= 1, "the MP table does not fit even one CPU");

/// Entry types.
const MP_PROCESSOR: u8 = 0;
const MP_BUS: u8 = 1;
const MP_IOAPIC: u8 = 2;
const MP_INTSRC: u8 = 3;
const MP_LINTSRC: u8 = 4;

/// MP spec revision 1.4.
const MP_SPEC_REV: u8 = 4;
const OEM_ID: &[u8; 8] = b"RUSTVMM ";
const PRODUCT_ID: &[u8; 12] = b"MICROVM     ";
const BUS_TYPE_ISA: &[u8; 6] = b"ISA   ";
const ISA_BUS_ID: u8 = 0;

const LAPIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1 << 0;
const CPU_BOOTPROCESSOR: u8 = 1 << 1;
const IOAPIC_ENABLED: u8 = 1 << 0;
/// Family 6, model 0, stepping 0.
const CPU_SIGNATURE: u32 = 6 << 8;
/// CPUID.1:EDX FPU and APIC.
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);

/// Interrupt types of I/O and local interrupt entries.
const MP_IRQ_INT: u8 = 0;
const MP_IRQ_NMI: u8 = 1;
const MP_IRQ_EXTINT: u8 = 3;
/// Polarity and trigger "conform to the bus" (ISA: active high, edge).
const MP_IRQ_FLAGS_DEFAULT: u16 = 0;
/// Destination "all local APICs".
const ALL_LOCAL_APICS: u8 = 0xff;

#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("the MP table needs at least one CPU (got 0)")]
    NoCpus,
    #[error(
        "{num_cpus} CPUs do not fit in the MP table: it would end at {end:#x}, past {MPTABLE_LIMIT:#x} (at most {MAX_CPUS} CPUs)"
    )]
    TooManyCpus { num_cpus: u8, end: u64 },
    #[error("cannot write the {size}-byte MP table at guest address {addr:#x}: {source}")]
    Write {
        addr: u64,
        size: usize,
        source: GuestMemoryError,
    },
}

/// Size in bytes of the floating pointer plus configuration table for `num_cpus`.
pub const fn mptable_size(num_cpus: u8) -> usize {
    FIXED_SIZE + num_cpus as usize * CPU_ENTRY_SIZE
}

/// The byte that makes the (wrapping) sum of `bytes` plus itself zero.
fn checksum(bytes: &[u8]) -> u8 {
    let sum = bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b));
    0u8.wrapping_sub(sum)
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    fn interrupt(&mut self, kind: u8, irq_type: u8, src_irq: u8, dst_apic: u8, dst_pin: u8) {
        self.u8(kind);
        self.u8(irq_type);
        self.u16(MP_IRQ_FLAGS_DEFAULT);
        self.u8(ISA_BUS_ID);
        self.u8(src_irq);
        self.u8(dst_apic);
        self.u8(dst_pin);
    }
}

/// Builds the floating pointer and configuration table for a table placed at
/// guest address `base`.
pub fn build_mptable(base: u64, num_cpus: u8) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 {
        return Err(MptableError::NoCpus);
    }
    let size = mptable_size(num_cpus);
    let end = base + size as u64;
    if num_cpus > MAX_CPUS || end > MPTABLE_LIMIT {
        return Err(MptableError::TooManyCpus { num_cpus, end });
    }
    let ioapic_id = num_cpus;
    let config_addr = base + MPF_SIZE as u64;
    let entry_count =
        usize::from(num_cpus) + 2 + usize::from(NUM_IOAPIC_PINS) + NUM_LOCAL_INTERRUPTS;

    // Floating pointer structure.
    let mut w = Writer(Vec::with_capacity(size));
    w.bytes(b"_MP_");
    w.u32(config_addr as u32);
    w.u8(1); // length in 16-byte units
    w.u8(MP_SPEC_REV);
    w.u8(0); // checksum, filled below
    w.bytes(&[0; 5]); // feature bytes: config table present, virtual-wire mode
    let mpf_checksum = checksum(&w.0[..MPF_SIZE]);
    w.0[10] = mpf_checksum;

    // Configuration table header.
    let header_start = w.0.len();
    w.bytes(b"PCMP");
    w.u16((size - MPF_SIZE) as u16); // base table length
    w.u8(MP_SPEC_REV);
    w.u8(0); // checksum, filled below
    w.bytes(OEM_ID);
    w.bytes(PRODUCT_ID);
    w.u32(0); // OEM table pointer
    w.u16(0); // OEM table size
    w.u16(entry_count as u16);
    w.u32(APIC_START as u32);
    w.u16(0); // extended table length
    w.u8(0); // extended table checksum
    w.u8(0); // reserved

    for cpu in 0..num_cpus {
        w.u8(MP_PROCESSOR);
        w.u8(cpu); // APIC ID
        w.u8(LAPIC_VERSION);
        w.u8(CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 });
        w.u32(CPU_SIGNATURE);
        w.u32(CPU_FEATURES);
        w.bytes(&[0; 8]);
    }

    w.u8(MP_BUS);
    w.u8(ISA_BUS_ID);
    w.bytes(BUS_TYPE_ISA);

    w.u8(MP_IOAPIC);
    w.u8(ioapic_id);
    w.u8(IOAPIC_VERSION);
    w.u8(IOAPIC_ENABLED);
    w.u32(IOAPIC_START as u32);

    for pin in 0..NUM_IOAPIC_PINS {
        w.interrupt(MP_INTSRC, MP_IRQ_INT, pin, ioapic_id, pin);
    }
    // The PIC's output goes to the BSP's LINT0; NMI to every CPU's LINT1.
    w.interrupt(MP_LINTSRC, MP_IRQ_EXTINT, 0, 0, 0);
    w.interrupt(MP_LINTSRC, MP_IRQ_NMI, 0, ALL_LOCAL_APICS, 1);

    let table_checksum = checksum(&w.0[header_start..]);
    w.0[header_start + 7] = table_checksum;
    debug_assert_eq!(w.0.len(), size);
    Ok(w.0)
}

/// Writes the MP table for `num_cpus` CPUs at `EBDA_START`.
pub fn setup_mptable(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let table = build_mptable(EBDA_START, num_cpus)?;
    mem.write_slice(&table, GuestAddress(EBDA_START))
        .map_err(|source| MptableError::Write {
            addr: EBDA_START,
            size: table.len(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes([b[off], b[off + 1]])
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
    }

    /// Splits the configuration table's entries by their type byte.
    fn entries(table: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let mut off = MPF_SIZE + HEADER_SIZE;
        while off < table.len() {
            let len = if table[off] == MP_PROCESSOR {
                CPU_ENTRY_SIZE
            } else {
                8
            };
            out.push(&table[off..off + len]);
            off += len;
        }
        assert_eq!(off, table.len());
        out
    }

    #[test]
    fn max_cpus_fits() {
        let table = build_mptable(EBDA_START, MAX_CPUS).unwrap();
        assert!(EBDA_START + table.len() as u64 <= MPTABLE_LIMIT);
        assert_eq!(MAX_CPUS, 254, "APIC IDs, not the room, are the limit");
    }

    #[test]
    fn floating_pointer() {
        let table = build_mptable(EBDA_START, 2).unwrap();
        let mpf = &table[..MPF_SIZE];
        assert_eq!(&mpf[0..4], b"_MP_");
        assert_eq!(u64::from(u32_at(mpf, 4)), EBDA_START + 16);
        assert_eq!(mpf[8], 1);
        assert_eq!(mpf[9], 4);
        assert_eq!(sum(mpf), 0, "floating pointer checksum");
        assert_eq!(&mpf[11..16], &[0; 5]);
    }

    #[test]
    fn header_and_checksum() {
        for n in [1, 2, 4, MAX_CPUS] {
            let table = build_mptable(EBDA_START, n).unwrap();
            assert_eq!(table.len(), mptable_size(n));
            let config = &table[MPF_SIZE..];
            assert_eq!(&config[0..4], b"PCMP");
            assert_eq!(usize::from(u16_at(config, 4)), config.len());
            assert_eq!(config[6], 4);
            assert_eq!(sum(config), 0, "config table checksum for {n} CPUs");
            assert_eq!(&config[8..16], OEM_ID);
            assert_eq!(
                usize::from(u16_at(config, 34)),
                usize::from(n) + 1 + 1 + 24 + 2
            );
            assert_eq!(u64::from(u32_at(config, 36)), APIC_START);
            assert_eq!(entries(&table).len(), usize::from(u16_at(config, 34)));
        }
    }

    #[test]
    fn entry_contents() {
        let n = 3;
        let table = build_mptable(EBDA_START, n).unwrap();
        let all = entries(&table);
        let of = |t: u8| {
            all.iter()
                .filter(move |e| e[0] == t)
                .copied()
                .collect::<Vec<_>>()
        };

        let cpus = of(MP_PROCESSOR);
        assert_eq!(cpus.len(), 3);
        for (i, cpu) in cpus.iter().enumerate() {
            assert_eq!(usize::from(cpu[1]), i, "APIC ID");
            assert_eq!(cpu[2], 0x14);
            assert_ne!(cpu[3] & CPU_ENABLED, 0);
            assert_eq!(cpu[3] & CPU_BOOTPROCESSOR != 0, i == 0, "BSP flag");
            assert_eq!(u32_at(cpu, 4), CPU_SIGNATURE);
            assert_ne!(u32_at(cpu, 8) & (1 << 9), 0, "APIC feature");
        }

        let buses = of(MP_BUS);
        assert_eq!(buses.len(), 1);
        assert_eq!(&buses[0][2..8], b"ISA   ");

        let ioapics = of(MP_IOAPIC);
        assert_eq!(ioapics.len(), 1);
        assert_eq!(ioapics[0][1], n, "IOAPIC ID follows the CPUs");
        assert_eq!(ioapics[0][2], 0x11);
        assert_eq!(ioapics[0][3], 1);
        assert_eq!(u64::from(u32_at(ioapics[0], 4)), IOAPIC_START);

        let intsrc = of(MP_INTSRC);
        assert_eq!(intsrc.len(), 24);
        for (pin, e) in intsrc.iter().enumerate() {
            assert_eq!(e[1], MP_IRQ_INT);
            assert_eq!(e[4], ISA_BUS_ID);
            assert_eq!(usize::from(e[5]), pin, "source IRQ");
            assert_eq!(e[6], n, "destination IOAPIC");
            assert_eq!(usize::from(e[7]), pin, "destination pin");
        }

        let lint = of(MP_LINTSRC);
        assert_eq!(lint.len(), 2);
        assert_eq!((lint[0][1], lint[0][7]), (MP_IRQ_EXTINT, 0));
        assert_eq!((lint[1][1], lint[1][6], lint[1][7]), (MP_IRQ_NMI, 0xff, 1));
    }

    #[test]
    fn rejects_zero_and_too_many_cpus() {
        assert!(matches!(
            build_mptable(EBDA_START, 0),
            Err(MptableError::NoCpus)
        ));
        if MAX_CPUS < u8::MAX {
            let err = build_mptable(EBDA_START, MAX_CPUS + 1).unwrap_err();
            assert!(matches!(err, MptableError::TooManyCpus { .. }));
            assert!(
                err.to_string().contains(&format!("at most {MAX_CPUS}")),
                "{err}"
            );
        }
        assert!(build_mptable(EBDA_START, 255).is_err());
        assert!(build_mptable(EBDA_START, 254).is_err() || MAX_CPUS == 254);
    }

    #[test]
    fn writes_to_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        setup_mptable(&mem, 4).unwrap();
        let mut buf = vec![0u8; mptable_size(4)];
        mem.read_slice(&mut buf, GuestAddress(EBDA_START)).unwrap();
        assert_eq!(buf, build_mptable(EBDA_START, 4).unwrap());
        assert_eq!(
            setup_mptable(&mem, 0).unwrap_err().to_string(),
            MptableError::NoCpus.to_string()
        );
    }

    #[test]
    fn the_largest_table_fits_in_a_guest_of_1_mib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        setup_mptable(&mem, MAX_CPUS).unwrap();
        let table = build_mptable(EBDA_START, MAX_CPUS).unwrap();
        assert!(
            EBDA_START + table.len() as u64 > 0xa_0000,
            "the test should cover a table reaching past the EBDA"
        );
        let mut written = vec![0u8; table.len()];
        mem.read_slice(&mut written, GuestAddress(EBDA_START))
            .unwrap();
        assert_eq!(written, table);
    }

    #[test]
    fn write_error_names_address() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x9_0000)]).unwrap();
        let err = setup_mptable(&mem, 1).unwrap_err();
        assert!(err.to_string().contains("0x9fc00"), "{err}");
    }
}
