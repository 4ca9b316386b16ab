//! x86_64 boot details: memory layout, boot parameters, page tables, GDT, CPUID,
//! MSRs, LAPIC and the MP table.

pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod interrupts;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;
