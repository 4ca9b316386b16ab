//! What a VM is made of, and the checks that catch bad input before any VM exists.
//!
//! The checks here are cheap and need no KVM, so `vmctl` runs them on the host even
//! when the VMM itself will run in the nested host: a user hears about a typo at once.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::arch::x86_64::boot::BootError;
use crate::arch::x86_64::layout;

/// Kernel arguments every guest gets; `reboot=k` makes a guest reboot reach the
/// i8042 reset, which is how the VMM learns that the guest is done.
/// `cpu_init_udelay=0`: a vCPU needs none of the 10 ms INIT settling delay that Linux
/// 6.1 keeps for CPUs it does not know as modern (Intel families other than 6, such
/// as recent ones), paid once per vCPU it starts.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 quiet cpu_init_udelay=0";
/// Bounded by the MP table: 8-bit APIC IDs, the IOAPIC taking the one after the last CPU.
pub const MAX_VCPUS: u32 = crate::arch::x86_64::mptable::MAX_CPUS as u32;
pub const DEFAULT_VCPUS: u32 = 1;
pub const DEFAULT_MEMORY_MIB: u64 = 256;
pub const DEFAULT_KVM_DEVICE: &str = "/dev/kvm";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
}

impl DiskConfig {
    /// Parses `PATH[:ro]`.
    pub fn parse(spec: &str) -> Self {
        match spec.strip_suffix(":ro") {
            Some(path) => Self {
                path: PathBuf::from(path),
                read_only: true,
            },
            None => Self {
                path: PathBuf::from(spec),
                read_only: false,
            },
        }
    }
}

/// A virtio-vsock device whose host side is a Unix socket (Firecracker's hybrid vsock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockConfig {
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

/// A virtio-fs device served by a vhost-user backend (virtiofsd) listening on
/// `socket_path`; the guest mounts it by `tag`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsConfig {
    pub socket_path: PathBuf,
    pub tag: String,
}

/// The longest tag the virtio-fs configuration space holds.
pub const MAX_FS_TAG_LEN: usize = 36;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub disks: Vec<DiskConfig>,
    /// Appended to [`DEFAULT_CMDLINE`].
    pub extra_cmdline: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub kvm_device: PathBuf,
    /// Adds a virtio-rng device (the guest's entropy source).
    pub rng: bool,
    pub vsock: Option<VsockConfig>,
    /// virtio-fs devices, placed after vsock.
    pub filesystems: Vec<FsConfig>,
    /// Adds a virtio-balloon device for free page reporting, placed last: the guest
    /// tells the VMM which memory it freed, and the VMM gives those pages back to the
    /// host (see `devices::virtio::balloon`).
    pub free_page_reporting: bool,
    /// Adds a virtio console (the guest's hvc0), placed after the balloon: the guest
    /// agent writes its log there, a buffer per notification rather than a VM exit per
    /// byte of the 8250 (see `devices::virtio::console`).
    pub virtio_console: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("kernel {}: no such file", .0.display())]
    KernelMissing(PathBuf),
    #[error("{what} {}: cannot read it: {reason}", .path.display())]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{what} {}: is a directory, not a file", .path.display())]
    IsDirectory { what: &'static str, path: PathBuf },
    #[error("kernel {}: not a kernel (neither an x86_64 ELF vmlinux nor a bzImage)", .0.display())]
    NotAKernel(PathBuf),
    #[error("kernel {} needs {needed_mib} MiB of guest memory but the VM has {memory_mib} MiB; raise --memory", .path.display())]
    KernelTooLarge {
        path: PathBuf,
        needed_mib: u64,
        memory_mib: u64,
    },
    #[error("initrd {} ({size_mib} MiB) does not fit in guest memory ({memory_mib} MiB) after the kernel; raise --memory", .path.display())]
    InitrdTooLarge {
        path: PathBuf,
        size_mib: u64,
        memory_mib: u64,
    },
    #[error("initrd {}: no such file", .0.display())]
    InitrdMissing(PathBuf),
    #[error("disk {}: no such file", .0.display())]
    DiskMissing(PathBuf),
    #[error("kernel command line is {len} bytes; the limit is {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error(
        "kernel command line holds {character:?}, which it cannot: only printable ASCII \
         characters and spaces (no tabs, newlines or other characters)"
    )]
    CmdlineInvalid { character: char },
    #[error("--cpus 0: a VM needs at least 1 vCPU")]
    NoVcpus,
    #[error("--cpus {requested}: at most {max} vCPUs are supported")]
    TooManyVcpus { requested: u32, max: u32 },
    #[error("--memory 0: a VM needs memory (try --memory 256)")]
    NoMemory,
    #[error("--memory {requested_mib}: this host has only {host_mib} MiB of RAM")]
    TooMuchMemory { requested_mib: u64, host_mib: u64 },
    #[error("virtio-fs tag {tag:?}: a tag is 1 to {max} bytes")]
    BadFsTag { tag: String, max: usize },
    #[error("too many virtio devices ({count}); at most {max} fit")]
    TooManyDevices { count: usize, max: usize },
}

impl VmConfig {
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            initrd: None,
            disks: Vec::new(),
            extra_cmdline: String::new(),
            vcpus: DEFAULT_VCPUS,
            memory_mib: DEFAULT_MEMORY_MIB,
            kvm_device: PathBuf::from(DEFAULT_KVM_DEVICE),
            rng: true,
            vsock: None,
            filesystems: Vec::new(),
            free_page_reporting: true,
            virtio_console: true,
        }
    }

    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib.saturating_mul(1 << 20)
    }

    /// Number of virtio-mmio devices, in the order they are placed: disks, rng, vsock,
    /// filesystems, balloon, console.
    pub fn virtio_device_count(&self) -> usize {
        self.disks.len()
            + usize::from(self.rng)
            + usize::from(self.vsock.is_some())
            + self.filesystems.len()
            + usize::from(self.free_page_reporting)
            + usize::from(self.virtio_console)
    }

    /// The full kernel command line: defaults, the virtio-mmio devices, then the
    /// user's arguments (last, so they can override the defaults).
    pub fn kernel_cmdline(&self) -> String {
        let mut cmdline = String::from(DEFAULT_CMDLINE);
        for index in 0..self.virtio_device_count() {
            let (addr, irq) = layout::virtio_mmio_slot(index);
            cmdline.push_str(&format!(
                " virtio_mmio.device={}K@{addr:#x}:{irq}",
                layout::VIRTIO_MMIO_WINDOW_SIZE >> 10
            ));
        }
        let extra = self.extra_cmdline.trim();
        if !extra.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(extra);
        }
        cmdline
    }

    /// Whether [`Self::kernel_cmdline`] fits the boot protocol's buffer and holds
    /// only what a kernel command line can (what linux-loader accepts).
    pub fn check_cmdline(&self) -> Result<(), ConfigError> {
        let cmdline = self.kernel_cmdline();
        if let Some(character) = cmdline.chars().find(|c| !matches!(c, ' '..='~')) {
            return Err(ConfigError::CmdlineInvalid { character });
        }
        let len = cmdline.len();
        // The kernel needs room for the terminating NUL.
        if len >= layout::CMDLINE_MAX_SIZE {
            return Err(ConfigError::CmdlineTooLong {
                len,
                max: layout::CMDLINE_MAX_SIZE - 1,
            });
        }
        Ok(())
    }

    /// Checks everything that can be checked without KVM. `host_memory_mib` is the
    /// host's RAM (see [`host_memory_mib`]).
    pub fn validate(&self, host_memory_mib: u64) -> Result<(), ConfigError> {
        if self.vcpus == 0 {
            return Err(ConfigError::NoVcpus);
        }
        if self.vcpus > MAX_VCPUS {
            return Err(ConfigError::TooManyVcpus {
                requested: self.vcpus,
                max: MAX_VCPUS,
            });
        }
        if self.memory_mib == 0 {
            return Err(ConfigError::NoMemory);
        }
        if self.memory_mib > host_memory_mib {
            return Err(ConfigError::TooMuchMemory {
                requested_mib: self.memory_mib,
                host_mib: host_memory_mib,
            });
        }
        let count = self.virtio_device_count();
        if count > layout::MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices {
                count,
                max: layout::MAX_VIRTIO_DEVICES,
            });
        }
        self.check_cmdline()?;

        let low_ram_end = self.memory_bytes().min(layout::MMIO_GAP_START);
        let kernel_end = kernel_memory_end(&self.kernel)?;
        if kernel_end > low_ram_end {
            return Err(ConfigError::KernelTooLarge {
                path: self.kernel.clone(),
                needed_mib: kernel_end.div_ceil(1 << 20),
                memory_mib: self.memory_mib,
            });
        }
        if let Some(initrd) = &self.initrd {
            let size = open_regular(initrd, "initrd", ConfigError::InitrdMissing)?
                .metadata()
                .map_err(|e| unreadable("initrd", initrd, e))?
                .len();
            // Placed as the boot protocol allows: above the kernel, in the low RAM
            // and below its address limit.
            if crate::arch::x86_64::boot::initrd_address(low_ram_end, size, kernel_end).is_none() {
                return Err(ConfigError::InitrdTooLarge {
                    path: initrd.clone(),
                    size_mib: size.div_ceil(1 << 20),
                    memory_mib: self.memory_mib,
                });
            }
        }
        for disk in &self.disks {
            open_regular(&disk.path, "disk", ConfigError::DiskMissing)?;
        }
        for fs in &self.filesystems {
            if fs.tag.is_empty() || fs.tag.len() > MAX_FS_TAG_LEN {
                return Err(ConfigError::BadFsTag {
                    tag: fs.tag.clone(),
                    max: MAX_FS_TAG_LEN,
                });
            }
        }
        Ok(())
    }
}

fn unreadable(what: &'static str, path: &Path, e: std::io::Error) -> ConfigError {
    ConfigError::Unreadable {
        what,
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Opens `path` for reading, refusing directories.
fn open_regular(
    path: &Path,
    what: &'static str,
    missing: fn(PathBuf) -> ConfigError,
) -> Result<File, ConfigError> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => missing(path.to_path_buf()),
        _ => unreadable(what, path, e),
    })?;
    let metadata = file.metadata().map_err(|e| unreadable(what, path, e))?;
    if metadata.is_dir() {
        return Err(ConfigError::IsDirectory {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(file)
}

/// The first guest-physical byte past the loaded kernel.
fn kernel_memory_end(path: &Path) -> Result<u64, ConfigError> {
    let mut file = open_regular(path, "kernel", ConfigError::KernelMissing)?;
    let not_a_kernel = || ConfigError::NotAKernel(path.to_path_buf());
    // An ELF64 file header.
    let mut header = [0u8; 0x40];
    let len = read_up_to(&mut file, &mut header).map_err(|e| unreadable("kernel", path, e))?;
    let header = &header[..len];
    if header.starts_with(b"\x7fELF") {
        elf_memory_end(&mut file, header).ok_or_else(not_a_kernel)
    } else {
        match crate::arch::x86_64::boot::bzimage_memory_end(&mut file) {
            Ok(Some(end)) => Ok(end),
            Err(BootError::ReadKernel(e)) => Err(unreadable("kernel", path, e)),
            Ok(None) | Err(_) => Err(not_a_kernel()),
        }
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// End of the highest PT_LOAD segment of an x86_64 ELF64 file, by physical address.
fn elf_memory_end(file: &mut File, header: &[u8]) -> Option<u64> {
    const ELFCLASS64: u8 = 2;
    const EM_X86_64: u16 = 62;
    const PT_LOAD: u32 = 1;
    let u16_at = |b: &[u8], o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |b: &[u8], o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |b: &[u8], o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    if header.get(4) != Some(&ELFCLASS64) || u16_at(header, 0x12)? != EM_X86_64 {
        return None;
    }
    let phoff = u64_at(header, 0x20)?;
    let phentsize = usize::from(u16_at(header, 0x36)?);
    let phnum = usize::from(u16_at(header, 0x38)?);
    if phentsize < 0x38 || phnum == 0 || phnum > 64 {
        return None;
    }
    let mut table = vec![0u8; phentsize * phnum];
    file.seek(SeekFrom::Start(phoff)).ok()?;
    file.read_exact(&mut table).ok()?;
    let mut end = None;
    for entry in table.chunks_exact(phentsize) {
        if u32_at(entry, 0)? == PT_LOAD {
            let segment_end = u64_at(entry, 0x18)?.checked_add(u64_at(entry, 0x28)?)?;
            end = Some(end.map_or(segment_end, |e: u64| e.max(segment_end)));
        }
    }
    end
}

/// The host's total RAM in MiB (from /proc/meminfo), if it can be read.
pub fn host_memory_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file holding `bytes`, removed when the returned path drops.
    fn temp_file(bytes: &[u8]) -> tempfile::TempPath {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(bytes).unwrap();
        file.into_temp_path()
    }

    /// A minimal ELF64 x86_64 header with one PT_LOAD segment at `paddr`.
    fn tiny_elf(paddr: u64, memsz: u64) -> Vec<u8> {
        let mut elf = vec![0u8; 0x40 + 0x38];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let ph = &mut elf[0x40..];
        ph[..4].copy_from_slice(&1u32.to_le_bytes());
        ph[0x18..0x20].copy_from_slice(&paddr.to_le_bytes());
        ph[0x28..0x30].copy_from_slice(&memsz.to_le_bytes());
        elf
    }

    /// A config whose kernel holds `bytes`; the kernel file lives as long as the path.
    fn config_with_kernel(bytes: &[u8]) -> (VmConfig, tempfile::TempPath) {
        let kernel = temp_file(bytes);
        (VmConfig::new(kernel.to_path_buf()), kernel)
    }

    #[test]
    fn disk_spec_parses_read_only_suffix() {
        assert_eq!(
            DiskConfig::parse("/a/b.img:ro"),
            DiskConfig {
                path: "/a/b.img".into(),
                read_only: true
            }
        );
        assert!(!DiskConfig::parse("/a/b.img").read_only);
    }

    #[test]
    fn cmdline_declares_devices_then_user_arguments() {
        let mut config = VmConfig::new("/k".into());
        config.disks.push(DiskConfig::parse("/d"));
        config.extra_cmdline = " loglevel=7 ".into();
        assert_eq!(
            config.kernel_cmdline(),
            format!(
                "{DEFAULT_CMDLINE} virtio_mmio.device=4K@0xd0000000:5 \
                 virtio_mmio.device=4K@0xd0001000:6 virtio_mmio.device=4K@0xd0002000:7 \
                 virtio_mmio.device=4K@0xd0003000:8 loglevel=7"
            )
        );
        config.free_page_reporting = false;
        assert_eq!(config.virtio_device_count(), 3);
        config.virtio_console = false;
        assert_eq!(config.virtio_device_count(), 2);
    }

    #[test]
    fn accepts_a_kernel_that_fits() {
        let (config, _kernel) = config_with_kernel(&tiny_elf(16 << 20, 4 << 20));
        assert_eq!(config.validate(1 << 20), Ok(()));
    }

    #[test]
    fn rejects_bad_vcpu_and_memory_values() {
        let (mut config, _kernel) = config_with_kernel(&tiny_elf(16 << 20, 1 << 20));
        config.vcpus = 0;
        assert_eq!(config.validate(1 << 20), Err(ConfigError::NoVcpus));
        config.vcpus = 1000;
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::TooManyVcpus { .. })
        ));
        config.vcpus = 1;
        config.memory_mib = 0;
        assert_eq!(config.validate(1 << 20), Err(ConfigError::NoMemory));
        config.memory_mib = 4096;
        assert!(matches!(
            config.validate(2048),
            Err(ConfigError::TooMuchMemory { .. })
        ));
    }

    #[test]
    fn rejects_what_is_not_a_kernel() {
        let (config, _kernel) = config_with_kernel(b"definitely not a kernel image");
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::NotAKernel(_))
        ));
        let mut elf = tiny_elf(0, 1);
        elf[0x12] = 40; // ARM
        let (config, _kernel) = config_with_kernel(&elf);
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::NotAKernel(_))
        ));
        let config = VmConfig::new(std::env::temp_dir());
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::IsDirectory { .. })
        ));
        let config = VmConfig::new("/nonexistent/vmlinux".into());
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::KernelMissing(_))
        ));
    }

    #[test]
    fn rejects_kernel_and_initrd_beyond_memory() {
        let (mut config, _kernel) = config_with_kernel(&tiny_elf(16 << 20, 20 << 20));
        config.memory_mib = 32;
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::KernelTooLarge { .. })
        ));
        config.memory_mib = 64;
        let initrd = temp_file(b"");
        File::options()
            .write(true)
            .open(&initrd)
            .unwrap()
            .set_len(40 << 20)
            .unwrap();
        config.initrd = Some(initrd.to_path_buf());
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::InitrdTooLarge { .. })
        ));
        config.memory_mib = 128;
        assert_eq!(config.validate(1 << 20), Ok(()));
    }

    /// A bzImage's setup sectors and header (boot protocol 2.15, 64-bit), with
    /// `init_size` bytes to decompress into at its preferred address, 16 MiB.
    fn tiny_bzimage(init_size: u32) -> Vec<u8> {
        let mut image = vec![0u8; 8 << 10];
        image[0x1f1] = 4; // setup_sects
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        image[0x211] = 1; // loadflags: LOADED_HIGH
        image[0x230..0x234].copy_from_slice(&(2u32 << 20).to_le_bytes());
        image[0x236..0x238].copy_from_slice(&1u16.to_le_bytes()); // XLF_KERNEL_64
        image[0x258..0x260].copy_from_slice(&(16u64 << 20).to_le_bytes());
        image[0x260..0x264].copy_from_slice(&init_size.to_le_bytes());
        image
    }

    /// A bzImage decompresses at its preferred address (16 MiB), not at 1 MiB: what it
    /// needs is counted from there, as the load does.
    #[test]
    fn a_bzimage_needs_memory_up_to_the_end_of_its_decompression() {
        let (mut config, _kernel) = config_with_kernel(&tiny_bzimage(20 << 20));
        config.memory_mib = 32;
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::KernelTooLarge { needed_mib: 36, .. })
        ));
        config.memory_mib = 40;
        assert_eq!(config.validate(1 << 20), Ok(()));
    }

    /// A file cut short inside its setup header is no kernel, and no panic.
    #[test]
    fn a_truncated_bzimage_is_not_a_kernel() {
        let image = tiny_bzimage(1 << 20);
        for len in [0x206, 0x210, 0x262] {
            let (config, _kernel) = config_with_kernel(&image[..len]);
            assert!(matches!(
                config.validate(1 << 20),
                Err(ConfigError::NotAKernel(_))
            ));
        }
    }

    #[test]
    fn rejects_a_long_cmdline_and_missing_disks() {
        let (mut config, _kernel) = config_with_kernel(&tiny_elf(16 << 20, 1 << 20));
        config.extra_cmdline = "x".repeat(3000);
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::CmdlineTooLong { .. })
        ));
        for (extra, character) in [("x=\u{e9}", '\u{e9}'), ("a\tb", '\t')] {
            config.extra_cmdline = extra.into();
            assert_eq!(
                config.validate(1 << 20),
                Err(ConfigError::CmdlineInvalid { character })
            );
        }
        config.extra_cmdline.clear();
        config
            .disks
            .push(DiskConfig::parse("/nonexistent/disk.img"));
        assert!(matches!(
            config.validate(1 << 20),
            Err(ConfigError::DiskMissing(_))
        ));
    }

    #[test]
    fn host_memory_is_known_here() {
        assert!(host_memory_mib().is_some_and(|mib| mib > 0));
    }
}
