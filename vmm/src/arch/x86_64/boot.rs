//! Loading the kernel and initrd, and the Linux "zero page" (`struct boot_params`)
//! for the 64-bit boot protocol (Documentation/arch/x86/boot.rst).
//!
//! Two kernel formats are accepted:
//! - an uncompressed ELF `vmlinux`, loaded at its segments' physical addresses and
//!   entered at its ELF entry point (the physical address of `startup_64`);
//! - a `bzImage`, whose protected-mode payload is loaded at `HIMEM_START` and entered
//!   at its 64-bit entry point, 0x200 bytes into the payload. Its setup header is kept
//!   so the zero page carries what the kernel declared about itself.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{
    boot_e820_entry, boot_params, setup_header, E820_MAX_ENTRIES_ZEROPAGE, LOADED_HIGH,
    XLF_KERNEL_64,
};
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader};
use vm_memory::{
    Address, ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryRegion,
};

use super::layout::{
    ram_ranges, CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, LOW_RAM_END, ZERO_PAGE_START,
};
use super::paging::IDENTITY_MAPPED_SIZE;
use crate::memory::GuestMemoryMmap;

/// "HdrS": the setup header magic.
pub const BOOT_HDR_MAGIC: u32 = 0x5372_6448;
/// The boot sector signature.
pub const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// "Undefined" boot loader ID (we have none assigned).
pub const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// Physical alignment of the kernel, for a vmlinux (a bzImage declares its own).
pub const DEFAULT_KERNEL_ALIGNMENT: u32 = 0x0100_0000;
/// Offset of the 64-bit entry point in a bzImage's protected-mode payload.
pub const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Highest address the initrd may occupy (inclusive), like `initrd_addr_max`.
pub const INITRD_ADDR_MAX: u64 = 0x3fff_ffff;
/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;

const PAGE_SIZE: u64 = 0x1000;
const MIB: u64 = 1 << 20;

/// Offset of the setup header in a bzImage file (and in `boot_params`).
const SETUP_HEADER_OFFSET: u64 = 0x1f1;
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const ELF_HEADER_SIZE: usize = 64;
const ELF_PHDR_SIZE: usize = 56;
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const EM_X86_64: u16 = 62;
const PT_LOAD: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot read the kernel image: {0}")]
    ReadKernel(std::io::Error),
    #[error("not a kernel (neither an ELF vmlinux nor a bzImage)")]
    NotAKernel,
    #[error("invalid ELF kernel: {0}")]
    InvalidElf(String),
    #[error("invalid bzImage kernel: {0}")]
    InvalidBzImage(String),
    #[error(
        "kernel does not fit in guest memory ({mem_mib} MiB): it needs guest memory up to {needed_end:#x}; raise --memory"
    )]
    KernelTooBig { mem_mib: u64, needed_end: u64 },
    #[error("cannot load the kernel into guest memory: {0}")]
    LoadKernel(linux_loader::loader::Error),
    #[error("cannot read the initrd: {0}")]
    ReadInitrd(std::io::Error),
    #[error(
        "initrd ({size_mib} MiB) does not fit in guest memory between the kernel's end {kernel_end:#x} and {limit:#x}; raise --memory"
    )]
    InitrdTooBig {
        size_mib: u64,
        kernel_end: u64,
        limit: u64,
    },
    #[error("cannot load the {size}-byte initrd at guest address {addr:#x}: {source}")]
    LoadInitrd {
        addr: u64,
        size: u64,
        source: GuestMemoryError,
    },
    #[error("invalid kernel command line: {0}")]
    InvalidCmdline(linux_loader::cmdline::Error),
    #[error("kernel command line is {len} bytes (with its NUL), more than the {max} allowed")]
    CmdlineTooLong { len: usize, max: usize },
    #[error(
        "kernel command line is {len} bytes (without its NUL), more than the {kernel_max} this \
         kernel accepts (cmdline_size in its bzImage header): shorten the command line (fewer \
         devices or extra kernel arguments) or use a kernel built with a larger \
         COMMAND_LINE_SIZE"
    )]
    CmdlineTooLongForKernel { len: usize, kernel_max: u32 },
    #[error("cannot write the kernel command line at guest address {addr:#x}: {source}")]
    WriteCmdline {
        addr: u64,
        source: linux_loader::loader::Error,
    },
    #[error("cannot write the boot parameters (zero page) at guest address {addr:#x}: {source}")]
    WriteBootParams { addr: u64, source: GuestMemoryError },
}

/// Where the kernel was loaded and how to enter it.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    /// The 64-bit entry point (rip).
    pub entry: GuestAddress,
    /// First guest address past everything the kernel occupies early on (its image,
    /// bss and, for a bzImage, the area it decompresses into): the initrd goes above.
    pub kernel_end: u64,
    /// The bzImage's setup header; `None` for a vmlinux.
    pub setup_header: Option<setup_header>,
}

fn mem_mib(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(|r| r.len()).sum::<u64>() / MIB
}

fn fits(mem: &GuestMemoryMmap, start: u64, len: u64) -> bool {
    match usize::try_from(len) {
        Ok(0) => mem.address_in_range(GuestAddress(start)),
        Ok(len) => mem.check_range(GuestAddress(start), len),
        Err(_) => false,
    }
}

/// Reads as many bytes as available into `buf` from `offset`; returns how many.
fn read_at(file: &mut File, offset: u64, buf: &mut [u8]) -> Result<usize, std::io::Error> {
    file.seek(SeekFrom::Start(offset))?;
    let mut done = 0;
    while done < buf.len() {
        match file.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn le_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn le_u64(b: &[u8], off: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(bytes)
}

/// A PT_LOAD segment: where it goes and how much memory it spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LoadSegment {
    paddr: u64,
    mem_size: u64,
}

/// The parts of an ELF64 header and its program headers the checks need.
#[derive(Debug, PartialEq, Eq)]
struct ElfInfo {
    entry: u64,
    segments: Vec<LoadSegment>,
}

/// Parses and sanity-checks a 64-bit x86 ELF's header and loadable segments.
fn parse_elf(file: &mut File, header: &[u8; ELF_HEADER_SIZE]) -> Result<ElfInfo, BootError> {
    let class = header[4];
    let data = header[5];
    let machine = le_u16(header, 18);
    if class != ELFCLASS64 || data != ELFDATA2LSB || machine != EM_X86_64 {
        return Err(BootError::InvalidElf(format!(
            "not a 64-bit little-endian x86-64 ELF (class {class}, data {data}, machine {machine})"
        )));
    }
    let entry = le_u64(header, 24);
    let phoff = le_u64(header, 32);
    let phentsize = usize::from(le_u16(header, 54));
    let phnum = usize::from(le_u16(header, 56));
    if phentsize != ELF_PHDR_SIZE {
        return Err(BootError::InvalidElf(format!(
            "program header size is {phentsize}, expected {ELF_PHDR_SIZE}"
        )));
    }
    let mut phdrs = vec![0u8; phnum * ELF_PHDR_SIZE];
    let got = read_at(file, phoff, &mut phdrs).map_err(BootError::ReadKernel)?;
    if got != phdrs.len() {
        return Err(BootError::InvalidElf(format!(
            "{phnum} program headers at offset {phoff:#x} run past the end of the file"
        )));
    }
    let mut segments = Vec::new();
    for phdr in phdrs.chunks_exact(ELF_PHDR_SIZE) {
        let p_type = le_u32(phdr, 0);
        let paddr = le_u64(phdr, 24);
        let file_size = le_u64(phdr, 32);
        let mem_size = le_u64(phdr, 40);
        // The loader skips segments with nothing in the file; so do the checks.
        if p_type != PT_LOAD || file_size == 0 {
            continue;
        }
        segments.push(LoadSegment {
            paddr,
            mem_size: mem_size.max(file_size),
        });
    }
    if segments.is_empty() {
        return Err(BootError::InvalidElf("no loadable segment".to_string()));
    }
    Ok(ElfInfo { entry, segments })
}

/// Checks a vmlinux's layout against guest memory; returns where it ends.
fn check_elf(mem: &GuestMemoryMmap, info: &ElfInfo) -> Result<u64, BootError> {
    if info.entry < HIMEM_START || info.entry >= IDENTITY_MAPPED_SIZE {
        return Err(BootError::InvalidElf(format!(
            "entry point {:#x} is outside [{HIMEM_START:#x}, {IDENTITY_MAPPED_SIZE:#x})",
            info.entry
        )));
    }
    let mut end = 0;
    for seg in &info.segments {
        if seg.paddr < HIMEM_START {
            return Err(BootError::InvalidElf(format!(
                "segment at {:#x} lies below {HIMEM_START:#x}, over the boot structures",
                seg.paddr
            )));
        }
        let seg_end = seg.paddr.checked_add(seg.mem_size).ok_or_else(|| {
            BootError::InvalidElf(format!("segment at {:#x} overflows", seg.paddr))
        })?;
        if !fits(mem, seg.paddr, seg.mem_size) {
            return Err(BootError::KernelTooBig {
                mem_mib: mem_mib(mem),
                needed_end: seg_end,
            });
        }
        end = end.max(seg_end);
    }
    Ok(end)
}

fn load_elf(
    mem: &GuestMemoryMmap,
    kernel: &mut File,
    header: &[u8; ELF_HEADER_SIZE],
) -> Result<LoadedKernel, BootError> {
    let info = parse_elf(kernel, header)?;
    let end = check_elf(mem, &info)?;
    let result = Elf::load(mem, None, kernel, Some(GuestAddress(HIMEM_START)))
        .map_err(BootError::LoadKernel)?;
    Ok(LoadedKernel {
        // With no load offset, linux-loader's kernel_load is the ELF entry point: the
        // physical address of startup_64, which is where a 64-bit boot jumps.
        entry: result.kernel_load,
        kernel_end: result.kernel_end.max(end),
        setup_header: None,
    })
}

fn align_up(value: u64, align: u64) -> Option<u64> {
    if align <= 1 {
        return Some(value);
    }
    let rem = value % align;
    if rem == 0 {
        Some(value)
    } else {
        value.checked_add(align - rem)
    }
}

/// Where a bzImage loaded at `HIMEM_START` with a `payload_size`-byte payload ends,
/// including the area it decompresses itself into (`init_size` bytes at its
/// preferred or aligned load address).
fn bzimage_end(hdr: &setup_header, payload_size: u64) -> Option<u64> {
    let image_end = HIMEM_START.checked_add(payload_size)?;
    let kernel_alignment = u64::from(hdr.kernel_alignment);
    let pref_address = hdr.pref_address;
    let init_size = u64::from(hdr.init_size);
    let decompress_at = align_up(HIMEM_START, kernel_alignment)?.max(pref_address);
    let decompress_end = decompress_at.checked_add(init_size)?;
    Some(image_end.max(decompress_end))
}

/// Where the bzImage `kernel`, whose setup header is `hdr`, ends once loaded (see
/// [`bzimage_end`]).
fn bzimage_file_end(kernel: &File, hdr: &setup_header) -> Result<u64, BootError> {
    let file_size = kernel.metadata().map_err(BootError::ReadKernel)?.len();
    let setup_sects = match hdr.setup_sects {
        0 => 4,
        n => u64::from(n),
    };
    let setup_size = (setup_sects + 1) * 512;
    let payload_size = file_size.checked_sub(setup_size).ok_or_else(|| {
        BootError::InvalidBzImage(format!(
            "file is {file_size} bytes, smaller than its {setup_size}-byte setup code"
        ))
    })?;
    bzimage_end(hdr, payload_size).ok_or_else(|| {
        BootError::InvalidBzImage("kernel size overflows the address space".to_string())
    })
}

/// Where `kernel` ends in guest memory once loaded, decompression area included, if
/// it is a bzImage (`None` if it has no setup header): the same figure the load
/// checks, for a configuration to be checked before any memory is set up.
pub fn bzimage_memory_end(kernel: &mut File) -> Result<Option<u64>, BootError> {
    match read_setup_header(kernel)? {
        Some(hdr) => bzimage_file_end(kernel, &hdr).map(Some),
        None => Ok(None),
    }
}

/// Reads a bzImage's setup header; `None` if the file has none.
fn read_setup_header(kernel: &mut File) -> Result<Option<setup_header>, BootError> {
    let mut hdr = setup_header::default();
    let size = std::mem::size_of::<setup_header>();
    let got =
        read_at(kernel, SETUP_HEADER_OFFSET, hdr.as_mut_slice()).map_err(BootError::ReadKernel)?;
    let magic = hdr.header;
    if got < size || magic != BOOT_HDR_MAGIC {
        return Ok(None);
    }
    Ok(Some(hdr))
}

fn load_bzimage(
    mem: &GuestMemoryMmap,
    kernel: &mut File,
    hdr: &setup_header,
) -> Result<LoadedKernel, BootError> {
    let version = hdr.version;
    let loadflags = hdr.loadflags;
    let xloadflags = hdr.xloadflags;
    if version < 0x020c || xloadflags & XLF_KERNEL_64 == 0 {
        return Err(BootError::InvalidBzImage(format!(
            "no 64-bit entry point (boot protocol {version:#x}, xloadflags {xloadflags:#x}); \
             need protocol 2.12+ with XLF_KERNEL_64"
        )));
    }
    if loadflags & LOADED_HIGH == 0 {
        return Err(BootError::InvalidBzImage(format!(
            "a zImage (loadflags {loadflags:#x}) cannot be loaded high"
        )));
    }
    let end = bzimage_file_end(kernel, hdr)?;
    // The payload and the decompression area, both from HIMEM_START upwards.
    if !fits(mem, HIMEM_START, end - HIMEM_START) {
        return Err(BootError::KernelTooBig {
            mem_mib: mem_mib(mem),
            needed_end: end,
        });
    }
    let result = BzImage::load(
        mem,
        Some(GuestAddress(HIMEM_START)),
        kernel,
        Some(GuestAddress(HIMEM_START)),
    )
    .map_err(BootError::LoadKernel)?;
    Ok(LoadedKernel {
        entry: result.kernel_load.unchecked_add(BZIMAGE_64BIT_ENTRY_OFFSET),
        kernel_end: result.kernel_end.max(end),
        setup_header: result.setup_header.or(Some(*hdr)),
    })
}

/// Loads a vmlinux (ELF) or bzImage kernel into guest memory.
pub fn load_kernel(mem: &GuestMemoryMmap, kernel: &mut File) -> Result<LoadedKernel, BootError> {
    let mut header = [0u8; ELF_HEADER_SIZE];
    let got = read_at(kernel, 0, &mut header).map_err(BootError::ReadKernel)?;
    if got >= ELF_MAGIC.len() && &header[..ELF_MAGIC.len()] == ELF_MAGIC {
        if got < ELF_HEADER_SIZE {
            return Err(BootError::InvalidElf(format!(
                "file is only {got} bytes, shorter than an ELF64 header"
            )));
        }
        return load_elf(mem, kernel, &header);
    }
    match read_setup_header(kernel)? {
        Some(hdr) => load_bzimage(mem, kernel, &hdr),
        None => Err(BootError::NotAKernel),
    }
}

/// The page-aligned address of a `size`-byte initrd placed as high as possible
/// below `lowmem_end` (and `INITRD_ADDR_MAX`) but above `kernel_end`.
pub fn initrd_address(lowmem_end: u64, size: u64, kernel_end: u64) -> Option<u64> {
    let top = lowmem_end.min(INITRD_ADDR_MAX + 1);
    let start = top.checked_sub(size)? & !(PAGE_SIZE - 1);
    let floor = align_up(kernel_end, PAGE_SIZE)?;
    (start >= floor).then_some(start)
}

/// Loads the initrd at the top of the first RAM region (see [`initrd_address`]);
/// returns its address and size.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    initrd: &mut File,
    kernel_end: u64,
) -> Result<(GuestAddress, u64), BootError> {
    let size = initrd.metadata().map_err(BootError::ReadInitrd)?.len();
    let lowmem_end = mem
        .find_region(GuestAddress(0))
        .map(|r| r.start_addr().raw_value() + r.len())
        .unwrap_or(0);
    let too_big = || BootError::InitrdTooBig {
        size_mib: size.div_ceil(MIB),
        kernel_end,
        limit: lowmem_end.min(INITRD_ADDR_MAX + 1),
    };
    let addr = initrd_address(lowmem_end, size, kernel_end).ok_or_else(too_big)?;
    let len = usize::try_from(size).map_err(|_| too_big())?;
    initrd.rewind().map_err(BootError::ReadInitrd)?;
    mem.read_exact_volatile_from(GuestAddress(addr), initrd, len)
        .map_err(|source| BootError::LoadInitrd { addr, size, source })?;
    Ok((GuestAddress(addr), size))
}

/// Writes the NUL-terminated command line at `CMDLINE_START`; returns its length
/// including the NUL (what `write_boot_params` takes as `cmdline_len`).
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &Cmdline) -> Result<usize, BootError> {
    let len = cmdline
        .as_cstring()
        .map_err(BootError::InvalidCmdline)?
        .as_bytes_with_nul()
        .len();
    if len > CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong {
            len,
            max: CMDLINE_MAX_SIZE,
        });
    }
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(|source| {
        BootError::WriteCmdline {
            addr: CMDLINE_START,
            source,
        }
    })?;
    Ok(len)
}

fn e820_ram(addr: u64, size: u64) -> boot_e820_entry {
    boot_e820_entry {
        addr,
        size,
        r#type: E820_RAM,
    }
}

/// The guest's memory map: low RAM below the EBDA, RAM from 1 MiB to the MMIO gap
/// (or the end of memory), and RAM above 4 GiB for what did not fit below the gap.
pub fn e820_entries(mem_size: u64) -> Vec<boot_e820_entry> {
    let mut entries = Vec::new();
    for (start, len) in ram_ranges(mem_size) {
        let end = start + len;
        if start == 0 {
            entries.push(e820_ram(0, end.min(LOW_RAM_END)));
            if end > HIMEM_START {
                entries.push(e820_ram(HIMEM_START, end - HIMEM_START));
            }
        } else if len > 0 {
            entries.push(e820_ram(start, len));
        }
    }
    entries
}

/// The longest command line, without its NUL, that the kernel whose setup header is
/// `hdr` accepts: its `cmdline_size` (boot protocol 2.06+; 255 before).
fn kernel_cmdline_max(hdr: &setup_header) -> u32 {
    let version = hdr.version;
    if version >= 0x0206 {
        hdr.cmdline_size
    } else {
        255
    }
}

/// Builds the zero page. `cmdline_len` includes the NUL; `initrd` is (address, size);
/// `setup_header` is the bzImage's own header, if any, whose fields are kept except
/// those a boot loader fills in. `cmdline_size` is one of those kept: it is the
/// kernel's word to the boot loader (how long a command line it takes), which the
/// command line is checked against, not a field for the loader to fill.
pub fn build_boot_params(
    mem_size: u64,
    cmdline_len: usize,
    initrd: Option<(GuestAddress, u64)>,
    setup_header: Option<setup_header>,
) -> Result<boot_params, BootError> {
    if cmdline_len > CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong {
            len: cmdline_len,
            max: CMDLINE_MAX_SIZE,
        });
    }
    if let Some(kernel) = &setup_header {
        let kernel_max = kernel_cmdline_max(kernel);
        let len = cmdline_len.saturating_sub(1);
        if len > usize::try_from(kernel_max).unwrap_or(usize::MAX) {
            return Err(BootError::CmdlineTooLongForKernel { len, kernel_max });
        }
    }
    let mut params = boot_params::default();
    let mut hdr = setup_header.unwrap_or_default();

    hdr.header = BOOT_HDR_MAGIC;
    hdr.boot_flag = BOOT_FLAG_MAGIC;
    hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    if hdr.kernel_alignment == 0 {
        hdr.kernel_alignment = DEFAULT_KERNEL_ALIGNMENT;
    }
    // The kernel is loaded at 1 MiB or above. KEEP_SEGMENTS only concerned the 32-bit
    // entry (and is ignored by current kernels): the 64-bit entry loads its own.
    hdr.loadflags |= LOADED_HIGH;
    hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.ext_cmd_line_ptr = (CMDLINE_START >> 32) as u32;
    let (initrd_addr, initrd_size) = initrd.map_or((0, 0), |(a, s)| (a.raw_value(), s));
    hdr.ramdisk_image = initrd_addr as u32;
    hdr.ramdisk_size = initrd_size as u32;
    params.ext_ramdisk_image = (initrd_addr >> 32) as u32;
    params.ext_ramdisk_size = (initrd_size >> 32) as u32;
    params.hdr = hdr;

    let entries = e820_entries(mem_size);
    for (slot, entry) in params
        .e820_table
        .iter_mut()
        .zip(entries.iter().take(E820_MAX_ENTRIES_ZEROPAGE))
    {
        *slot = *entry;
    }
    params.e820_entries = entries.len().min(E820_MAX_ENTRIES_ZEROPAGE) as u8;
    Ok(params)
}

/// Writes the zero page at `ZERO_PAGE_START` (see [`build_boot_params`]).
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    cmdline_len: usize,
    initrd: Option<(GuestAddress, u64)>,
    setup_header: Option<setup_header>,
) -> Result<(), BootError> {
    let params = build_boot_params(mem_size, cmdline_len, initrd, setup_header)?;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(|source| BootError::WriteBootParams {
            addr: ZERO_PAGE_START,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{FIRST_ADDR_PAST_32BITS, MMIO_GAP_START};
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A file in the temp directory, removed on drop.
    struct TempFile {
        path: PathBuf,
    }

    impl TempFile {
        fn new(contents: &[u8]) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "vmm-boot-test-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            let mut f = File::create(&path).unwrap();
            f.write_all(contents).unwrap();
            Self { path }
        }

        fn open(&self) -> File {
            File::open(&self.path).unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    fn guest_mem(size: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
    }

    const PAYLOAD: &[u8] = b"\xf4\xeb\xfd kernel text";

    /// A minimal ELF64 x86-64 executable with one PT_LOAD segment at `paddr`.
    fn tiny_elf(entry: u64, paddr: u64, mem_size: u64) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(b"\x7fELF");
        f.extend_from_slice(&[ELFCLASS64, ELFDATA2LSB, 1, 0]);
        f.extend_from_slice(&[0; 8]);
        f.extend_from_slice(&2u16.to_le_bytes()); // e_type: EXEC
        f.extend_from_slice(&EM_X86_64.to_le_bytes());
        f.extend_from_slice(&1u32.to_le_bytes()); // e_version
        f.extend_from_slice(&entry.to_le_bytes());
        f.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
        f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
        f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
        f.extend_from_slice(&64u16.to_le_bytes()); // e_ehsize
        f.extend_from_slice(&56u16.to_le_bytes()); // e_phentsize
        f.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
        f.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
        assert_eq!(f.len(), 64);
        let offset = 64 + 56u64;
        f.extend_from_slice(&PT_LOAD.to_le_bytes());
        f.extend_from_slice(&5u32.to_le_bytes()); // R+X
        f.extend_from_slice(&offset.to_le_bytes());
        f.extend_from_slice(&(0xffff_ffff_8000_0000 + paddr).to_le_bytes()); // p_vaddr
        f.extend_from_slice(&paddr.to_le_bytes());
        f.extend_from_slice(&(PAYLOAD.len() as u64).to_le_bytes());
        f.extend_from_slice(&mem_size.to_le_bytes());
        f.extend_from_slice(&0x20_0000u64.to_le_bytes());
        f.extend_from_slice(PAYLOAD);
        f
    }

    /// A minimal bzImage: one setup sector after the boot sector, then the payload.
    fn tiny_bzimage(xloadflags: u16, init_size: u32) -> Vec<u8> {
        let hdr = setup_header {
            setup_sects: 1,
            boot_flag: BOOT_FLAG_MAGIC,
            header: BOOT_HDR_MAGIC,
            version: 0x020f,
            loadflags: LOADED_HIGH,
            code32_start: HIMEM_START as u32,
            kernel_alignment: 0x20_0000,
            relocatable_kernel: 1,
            xloadflags,
            cmdline_size: 2047,
            initrd_addr_max: 0x7fff_ffff,
            pref_address: 0x100_0000,
            init_size,
            ..Default::default()
        };
        let mut f = vec![0u8; 1024];
        let off = SETUP_HEADER_OFFSET as usize;
        f[off..off + std::mem::size_of::<setup_header>()].copy_from_slice(hdr.as_slice());
        f.extend_from_slice(&[0x90; 0x200]);
        f.extend_from_slice(PAYLOAD);
        f
    }

    #[test]
    fn loads_elf_vmlinux() {
        let mem = guest_mem(32 << 20);
        let entry = 0x100_0000;
        let file = TempFile::new(&tiny_elf(entry, 0x100_0000, 0x2000));
        let loaded = load_kernel(&mem, &mut file.open()).unwrap();
        assert_eq!(loaded.entry, GuestAddress(entry));
        assert_eq!(loaded.kernel_end, 0x100_2000, "includes bss");
        assert!(loaded.setup_header.is_none());
        let mut buf = vec![0u8; PAYLOAD.len()];
        mem.read_slice(&mut buf, GuestAddress(0x100_0000)).unwrap();
        assert_eq!(buf, PAYLOAD);
    }

    #[test]
    fn garbage_is_not_a_kernel() {
        let mem = guest_mem(16 << 20);
        for contents in [&b""[..], b"hello", &[0xab; 4096][..]] {
            let file = TempFile::new(contents);
            let err = load_kernel(&mem, &mut file.open()).unwrap_err();
            assert!(matches!(err, BootError::NotAKernel), "{err}");
            assert_eq!(
                err.to_string(),
                "not a kernel (neither an ELF vmlinux nor a bzImage)"
            );
        }
    }

    #[test]
    fn elf_beyond_memory_does_not_fit() {
        let mem = guest_mem(16 << 20);
        let file = TempFile::new(&tiny_elf(0x100_0000, 0x100_0000, 0x1000));
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(
            matches!(
                err,
                BootError::KernelTooBig {
                    mem_mib: 16,
                    needed_end: 0x100_1000
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("16 MiB") && err.to_string().contains("--memory"));

        // Only the bss runs past the end of memory: still does not fit.
        let file = TempFile::new(&tiny_elf(0xf0_0000, 0xf0_0000, 0x20_0000));
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(matches!(err, BootError::KernelTooBig { .. }), "{err}");
    }

    #[test]
    fn elf_with_bad_layout_rejected() {
        let mem = guest_mem(16 << 20);
        // Entry below 1 MiB.
        let file = TempFile::new(&tiny_elf(0x8000, 0x10_0000, 0x1000));
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(matches!(err, BootError::InvalidElf(_)), "{err}");
        // Segment over the zero page.
        let file = TempFile::new(&tiny_elf(0x10_0000, 0x7000, 0x1000));
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(matches!(err, BootError::InvalidElf(_)), "{err}");
        // A 32-bit ELF.
        let mut elf32 = tiny_elf(0x10_0000, 0x10_0000, 0x1000);
        elf32[4] = 1;
        let file = TempFile::new(&elf32);
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(err.to_string().contains("class 1"), "{err}");
        // Truncated header.
        let file = TempFile::new(b"\x7fELF\x02\x01");
        let err = load_kernel(&mem, &mut file.open()).unwrap_err();
        assert!(matches!(err, BootError::InvalidElf(_)), "{err}");
    }

    #[test]
    fn loads_bzimage() {
        let mem = guest_mem(32 << 20);
        let file = TempFile::new(&tiny_bzimage(XLF_KERNEL_64, 0x40_0000));
        let loaded = load_kernel(&mem, &mut file.open()).unwrap();
        assert_eq!(loaded.entry, GuestAddress(HIMEM_START + 0x200));
        // Decompresses at pref_address (16 MiB) into init_size bytes.
        assert_eq!(loaded.kernel_end, 0x140_0000);
        let hdr = loaded.setup_header.unwrap();
        let (magic, code32_start) = (hdr.header, hdr.code32_start);
        assert_eq!(magic, BOOT_HDR_MAGIC);
        assert_eq!(u64::from(code32_start), HIMEM_START);
        let mut buf = vec![0u8; PAYLOAD.len()];
        mem.read_slice(&mut buf, GuestAddress(HIMEM_START + 0x200))
            .unwrap();
        assert_eq!(buf, PAYLOAD);
    }

    #[test]
    fn bzimage_checks() {
        let file = TempFile::new(&tiny_bzimage(0, 0x40_0000));
        let err = load_kernel(&guest_mem(32 << 20), &mut file.open()).unwrap_err();
        assert!(err.to_string().contains("64-bit entry point"), "{err}");

        let file = TempFile::new(&tiny_bzimage(XLF_KERNEL_64, 0x40_0000));
        let err = load_kernel(&guest_mem(16 << 20), &mut file.open()).unwrap_err();
        assert!(
            matches!(
                err,
                BootError::KernelTooBig {
                    mem_mib: 16,
                    needed_end: 0x140_0000
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn initrd_placement() {
        let mib = 1 << 20;
        // Top of memory, page aligned.
        assert_eq!(
            initrd_address(128 * mib, 0x1800, 2 * mib),
            Some(128 * mib - 0x2000)
        );
        assert_eq!(initrd_address(128 * mib, 4 * mib, 2 * mib), Some(124 * mib));
        // Capped below INITRD_ADDR_MAX.
        assert_eq!(
            initrd_address(MMIO_GAP_START, 4 * mib, 2 * mib),
            Some(INITRD_ADDR_MAX + 1 - 4 * mib)
        );
        // Exactly fits above the kernel (kernel end rounded up to a page).
        assert_eq!(initrd_address(16 * mib, 8 * mib, 8 * mib), Some(8 * mib));
        assert_eq!(initrd_address(16 * mib, 8 * mib, 8 * mib + 1), None);
        assert_eq!(initrd_address(16 * mib, 32 * mib, 0), None);
    }

    #[test]
    fn loads_initrd() {
        let mem = guest_mem(16 << 20);
        let contents: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let file = TempFile::new(&contents);
        let (addr, size) = load_initrd(&mem, &mut file.open(), 0x20_0000).unwrap();
        assert_eq!(size, 5000);
        assert_eq!(addr, GuestAddress((16 << 20) - 0x2000));
        let mut buf = vec![0u8; 5000];
        mem.read_slice(&mut buf, addr).unwrap();
        assert_eq!(buf, contents);
    }

    #[test]
    fn initrd_too_big() {
        let mem = guest_mem(4 << 20);
        let file = TempFile::new(&vec![0u8; 3 << 20]);
        let err = load_initrd(&mem, &mut file.open(), 0x20_0000).unwrap_err();
        assert!(
            matches!(err, BootError::InitrdTooBig { size_mib: 3, .. }),
            "{err}"
        );
        assert!(err
            .to_string()
            .starts_with("initrd (3 MiB) does not fit in guest memory"));
    }

    #[test]
    fn writes_cmdline() {
        let mem = guest_mem(1 << 20);
        let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).unwrap();
        cmdline.insert_str("console=ttyS0 reboot=k").unwrap();
        let len = write_cmdline(&mem, &cmdline).unwrap();
        assert_eq!(len, 23);
        let mut buf = vec![0u8; len];
        mem.read_slice(&mut buf, GuestAddress(CMDLINE_START))
            .unwrap();
        assert_eq!(buf, b"console=ttyS0 reboot=k\0");
    }

    #[test]
    fn cmdline_too_long() {
        let mem = guest_mem(1 << 20);
        let mut cmdline = Cmdline::new(4 * CMDLINE_MAX_SIZE).unwrap();
        cmdline.insert_str("x".repeat(CMDLINE_MAX_SIZE)).unwrap();
        let err = write_cmdline(&mem, &cmdline).unwrap_err();
        assert!(
            matches!(
                err,
                BootError::CmdlineTooLong {
                    len: 2049,
                    max: 2048
                }
            ),
            "{err}"
        );
    }

    fn ranges(entries: &[boot_e820_entry]) -> Vec<(u64, u64, u32)> {
        entries.iter().map(|e| (e.addr, e.size, e.r#type)).collect()
    }

    #[test]
    fn e820_small_memory() {
        assert_eq!(
            ranges(&e820_entries(128 << 20)),
            vec![
                (0, LOW_RAM_END, E820_RAM),
                (HIMEM_START, (128 << 20) - HIMEM_START, E820_RAM)
            ]
        );
    }

    #[test]
    fn e820_below_one_mib() {
        assert_eq!(
            ranges(&e820_entries(0x8_0000)),
            vec![(0, 0x8_0000, E820_RAM)]
        );
    }

    #[test]
    fn e820_skips_the_mmio_gap() {
        let mem_size = 4 << 30; // more than 3.25 GiB
        let entries = ranges(&e820_entries(mem_size));
        assert_eq!(
            entries,
            vec![
                (0, LOW_RAM_END, E820_RAM),
                (HIMEM_START, MMIO_GAP_START - HIMEM_START, E820_RAM),
                (FIRST_ADDR_PAST_32BITS, mem_size - MMIO_GAP_START, E820_RAM),
            ]
        );
        for (addr, size, _) in entries {
            assert!(addr + size <= MMIO_GAP_START || addr >= FIRST_ADDR_PAST_32BITS);
        }
        // Exactly at the gap start: no high range.
        assert_eq!(e820_entries(MMIO_GAP_START).len(), 2);
    }

    /// The kernel must not take the MP table's bytes for RAM before it has read them.
    #[test]
    fn the_largest_mp_table_is_outside_the_guests_ram() {
        use crate::arch::x86_64::layout::EBDA_START;
        use crate::arch::x86_64::mptable::{mptable_size, MAX_CPUS};
        let table = (EBDA_START, EBDA_START + mptable_size(MAX_CPUS) as u64);
        for (addr, size, _) in ranges(&e820_entries(4 << 30)) {
            assert!(
                addr + size <= table.0 || addr >= table.1,
                "RAM [{addr:#x}, {:#x}) overlaps the MP table [{:#x}, {:#x})",
                addr + size,
                table.0,
                table.1
            );
        }
    }

    #[test]
    fn boot_params_for_vmlinux() {
        let mem_size = 256 << 20;
        let initrd = (GuestAddress(0x0f00_0000), 0x12_3456);
        let params = build_boot_params(mem_size, 42, Some(initrd), None).unwrap();
        let hdr = params.hdr;
        let (magic, flag, loader, align) = (
            hdr.header,
            hdr.boot_flag,
            hdr.type_of_loader,
            hdr.kernel_alignment,
        );
        assert_eq!(magic, 0x5372_6448);
        assert_eq!(flag, 0xaa55);
        assert_eq!(loader, 0xff);
        assert_eq!(align, 0x0100_0000);
        let (ptr, size, loadflags) = (hdr.cmd_line_ptr, hdr.cmdline_size, hdr.loadflags);
        assert_eq!(u64::from(ptr), CMDLINE_START);
        assert_eq!(
            size, 0,
            "a vmlinux has no header whose cmdline_size could be kept"
        );
        assert_ne!(loadflags & LOADED_HIGH, 0);
        let (image, rsize) = (hdr.ramdisk_image, hdr.ramdisk_size);
        assert_eq!((image, rsize), (0x0f00_0000, 0x12_3456));
        let (ext_image, ext_size) = (params.ext_ramdisk_image, params.ext_ramdisk_size);
        assert_eq!((ext_image, ext_size), (0, 0));

        assert_eq!(params.e820_entries, 2);
        let table = params.e820_table;
        assert_eq!(ranges(&table[..2]), ranges(&e820_entries(mem_size)));
        assert_eq!(ranges(&table[2..3]), vec![(0, 0, 0)]);
    }

    #[test]
    fn boot_params_keep_bzimage_header() {
        let bz = setup_header {
            setup_sects: 27,
            version: 0x020f,
            kernel_alignment: 0x20_0000,
            init_size: 0x123_4000,
            xloadflags: XLF_KERNEL_64,
            loadflags: LOADED_HIGH | 0x80,
            cmdline_size: 2047,
            ..Default::default()
        };
        let params = build_boot_params(5 << 30, 10, None, Some(bz)).unwrap();
        let hdr = params.hdr;
        let (sects, version, align, init, xl, lf) = (
            hdr.setup_sects,
            hdr.version,
            hdr.kernel_alignment,
            hdr.init_size,
            hdr.xloadflags,
            hdr.loadflags,
        );
        assert_eq!(
            (sects, version, init, xl),
            (27, 0x020f, 0x123_4000, XLF_KERNEL_64)
        );
        assert_eq!(align, 0x20_0000, "the kernel's own alignment is kept");
        assert_eq!(lf, LOADED_HIGH | 0x80);
        let cmdline_size = hdr.cmdline_size;
        assert_eq!(
            cmdline_size, 2047,
            "the kernel's limit, not the command line's length"
        );
        let (magic, image, size) = (hdr.header, hdr.ramdisk_image, hdr.ramdisk_size);
        assert_eq!(magic, BOOT_HDR_MAGIC);
        assert_eq!((image, size), (0, 0));
        assert_eq!(params.e820_entries, 3);
    }

    #[test]
    fn boot_params_reject_long_cmdline() {
        assert!(build_boot_params(1 << 30, CMDLINE_MAX_SIZE + 1, None, None).is_err());
    }

    /// `cmdline_size` is the kernel's own limit (without the NUL): kept as the bzImage
    /// says, and a command line longer than it is refused with both sizes named.
    #[test]
    fn boot_params_keep_the_kernels_cmdline_size_and_hold_to_it() {
        let bz = setup_header {
            version: 0x020f,
            cmdline_size: 511,
            ..Default::default()
        };
        // 511 characters and the NUL.
        let params = build_boot_params(1 << 30, 512, None, Some(bz)).unwrap();
        let size = params.hdr.cmdline_size;
        assert_eq!(size, 511);
        let err = build_boot_params(1 << 30, 513, None, Some(bz)).unwrap_err();
        assert!(
            matches!(
                err,
                BootError::CmdlineTooLongForKernel {
                    len: 512,
                    kernel_max: 511
                }
            ),
            "{err}"
        );
        let message = err.to_string();
        assert!(
            message.contains("512 bytes") && message.contains("the 511 this kernel accepts"),
            "{message}"
        );
        // Before boot protocol 2.06 the field did not exist: 255 was the limit.
        let old = setup_header {
            version: 0x0205,
            ..Default::default()
        };
        assert!(build_boot_params(1 << 30, 256, None, Some(old)).is_ok());
        assert!(build_boot_params(1 << 30, 257, None, Some(old)).is_err());
    }

    #[test]
    fn writes_boot_params_to_zero_page() {
        let mem = guest_mem(16 << 20);
        write_boot_params(&mem, 16 << 20, 5, None, None).unwrap();
        let params: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let magic = params.hdr.header;
        assert_eq!(magic, BOOT_HDR_MAGIC);
        assert_eq!(params.e820_entries, 2);
        // boot_params is one page and fits before the stack/page tables.
        assert_eq!(std::mem::size_of::<boot_params>(), 4096);
    }
}
