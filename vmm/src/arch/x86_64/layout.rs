//! Where things live in guest physical memory, and which IRQ each device gets.
//!
//! Low memory follows the Linux x86 boot protocol's conventions (zero page, command
//! line, identity page tables below 1 MiB); the MMIO gap below 4 GiB holds the
//! virtio-mmio windows, the IOAPIC and the LAPIC, so RAM above the gap's start is
//! mapped from 4 GiB upwards.

/// Global descriptor table used for the 64-bit entry.
pub const BOOT_GDT_START: u64 = 0x500;
/// An empty interrupt descriptor table: the kernel installs its own before enabling IRQs.
pub const BOOT_IDT_START: u64 = 0x520;
/// The Linux "zero page" (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity-mapping page tables: PML4, one PDPT, one PD of 2 MiB pages (first 1 GiB).
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// The x86 kernel's `COMMAND_LINE_SIZE`, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// The Intel MP table goes in the EBDA, where the kernel scans for it.
pub const EBDA_START: u64 = 0x9fc00;
/// End of the legacy low-memory RAM region (start of the VGA/BIOS hole).
pub const LOW_RAM_END: u64 = EBDA_START;
/// First byte above the legacy hole: where "high" memory and the kernel start.
pub const HIMEM_START: u64 = 0x10_0000;

/// Start of the 32-bit MMIO gap; RAM never overlaps [MMIO_GAP_START, 4 GiB).
pub const MMIO_GAP_START: u64 = 0xd000_0000;
pub const FIRST_ADDR_PAST_32BITS: u64 = 1 << 32;
/// The first virtio-mmio window; each device gets `VIRTIO_MMIO_WINDOW_SIZE` after it.
pub const VIRTIO_MMIO_START: u64 = MMIO_GAP_START;
pub const VIRTIO_MMIO_WINDOW_SIZE: u64 = 0x1000;
pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const APIC_START: u64 = 0xfee0_0000;

/// Legacy I/O ports.
pub const SERIAL_COM1_PORT: u16 = 0x3f8;
pub const SERIAL_PORT_LEN: u16 = 8;
pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_PORT_LEN: u16 = 5;
/// The guest's init writes one byte here to stop the boot timer (as in Firecracker).
pub const BOOT_TIMER_PORT: u16 = 0x3f0;
pub const BOOT_TIMER_MAGIC: u8 = 123;

/// IRQ lines (IOAPIC pins).
pub const SERIAL_IRQ: u32 = 4;
pub const FIRST_VIRTIO_IRQ: u32 = 5;
/// The IOAPIC has 24 pins: virtio devices get 5..=23.
pub const LAST_VIRTIO_IRQ: u32 = 23;
pub const MAX_VIRTIO_DEVICES: usize = (LAST_VIRTIO_IRQ - FIRST_VIRTIO_IRQ + 1) as usize;

/// Guest-physical address and IRQ of the `index`-th virtio-mmio device.
pub fn virtio_mmio_slot(index: usize) -> (u64, u32) {
    (
        VIRTIO_MMIO_START + index as u64 * VIRTIO_MMIO_WINDOW_SIZE,
        FIRST_VIRTIO_IRQ + index as u32,
    )
}

/// The RAM ranges (start, length) for `mem_size` bytes of guest memory, split around
/// the MMIO gap.
pub fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (FIRST_ADDR_PAST_32BITS, mem_size - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_range() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_memory_skips_the_mmio_gap() {
        let ranges = ram_ranges(4 << 30);
        assert_eq!(ranges[0], (0, MMIO_GAP_START));
        assert_eq!(ranges[1].0, FIRST_ADDR_PAST_32BITS);
        assert_eq!(ranges[0].1 + ranges[1].1, 4 << 30);
    }

    #[test]
    fn virtio_slots_fit_below_the_ioapic() {
        let (last_addr, last_irq) = virtio_mmio_slot(MAX_VIRTIO_DEVICES - 1);
        assert!(last_addr + VIRTIO_MMIO_WINDOW_SIZE <= IOAPIC_START);
        assert_eq!(last_irq, LAST_VIRTIO_IRQ);
    }
}
