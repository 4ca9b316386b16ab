//! The virtio-blk device: one request queue over a raw image file.

use std::fs::File;
use std::os::fd::AsRawFd;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile};

use super::request::{self, Request, RequestType};
use super::{QUEUE_SIZE, SECTOR_SIZE, VIRTIO_BLK_ID_LEN};
use crate::devices::virtio::{
    read_into_guest, serve_single_queue, write_from_guest, ActivateError, ActiveQueue,
    GuestIoError, InterruptTrigger, QueueProgress, Served, VirtioDevice, DEVICE_ID_BLOCK,
    FEATURE_EVENT_IDX, FEATURE_VERSION_1,
};
use crate::memory::GuestMemoryMmap;

/// Layout of the part of `struct virtio_blk_config` we fill in: capacity (le64),
/// size_max (le32), seg_max (le32). Later fields read as 0.
const CONFIG_LEN: usize = 16;
const CONFIG_CAPACITY: usize = 0;
const CONFIG_SIZE_MAX: usize = 8;
const CONFIG_SEG_MAX: usize = 12;
/// Data segments per request: the queue size minus header and status.
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// The largest data segment, in whole pages: SEG_MAX of them stay within
/// [`request::MAX_REQUEST_BYTES`], so a driver that keeps to both never has a request
/// refused for its size.
const SIZE_MAX: u32 = (request::MAX_REQUEST_BYTES / SEG_MAX as u64) as u32 & !0xfff;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("cannot read the size of the disk image: {0}")]
    Metadata(std::io::Error),
    #[error("block device ID {id:?} is {len} bytes long, at most {VIRTIO_BLK_ID_LEN} allowed")]
    IdTooLong { id: String, len: usize },
    #[error("disk I/O at sector {sector} failed: {source}")]
    Io { sector: u64, source: GuestIoError },
    #[error("write at sector {sector} refused: the disk is read-only")]
    ReadOnly { sector: u64 },
    #[error("flushing the disk image failed: {0}")]
    Flush(std::io::Error),
    #[error("cannot write the device ID to guest buffer {addr:#x}")]
    IdWrite { addr: u64 },
}

/// The image file and the facts the guest sees about it.
struct Disk {
    file: File,
    read_only: bool,
    capacity_sectors: u64,
    id: [u8; VIRTIO_BLK_ID_LEN],
    /// Written since the last flush: a flush with nothing to make durable (on a
    /// read-only disk, never) costs the host no sync.
    dirty: bool,
    /// The driver did not take VIRTIO_BLK_F_FLUSH, so it sees a write-through cache
    /// (virtio 1.2, 5.2.6.2) and never flushes: every write is made durable before it
    /// completes.
    write_through: bool,
    /// Syncs of the host file so far, for the budget (see [`SYNC_COST`]).
    syncs: u64,
}

/// What one flush of the host file costs in [`ActiveQueue::serve`]'s budget: a
/// ring of flushes (or of small writes when write-through) must not hold the event
/// loop for a ring's worth of syncs.
const SYNC_COST: u64 = crate::devices::virtio::SERVE_BYTES / 16;

/// A virtio-blk device backed by a raw disk image.
pub struct Block {
    disk: Disk,
    avail_features: u64,
    acked_features: u64,
    config: [u8; CONFIG_LEN],
    queue_max_sizes: [u16; 1],
    active: Option<ActiveQueue>,
}

impl Block {
    /// A disk of `file`'s length rounded down to whole sectors. `id` (at most 20
    /// bytes) is what VIRTIO_BLK_T_GET_ID returns (Linux shows it as the serial).
    /// With `read_only` the device offers VIRTIO_BLK_F_RO and never writes `file`.
    pub fn new(file: File, read_only: bool, id: String) -> Result<Self, BlockError> {
        if id.len() > VIRTIO_BLK_ID_LEN {
            let len = id.len();
            return Err(BlockError::IdTooLong { id, len });
        }
        let mut id_bytes = [0u8; VIRTIO_BLK_ID_LEN];
        id_bytes[..id.len()].copy_from_slice(id.as_bytes());

        let size = file.metadata().map_err(BlockError::Metadata)?.len();
        let capacity_sectors = size / SECTOR_SIZE;
        if !size.is_multiple_of(SECTOR_SIZE) {
            tracing::warn!(
                "disk image size {size} is not a multiple of {SECTOR_SIZE}; the last {} bytes are not visible",
                size % SECTOR_SIZE
            );
        }

        let mut avail_features = FEATURE_VERSION_1
            | FEATURE_EVENT_IDX
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_SIZE_MAX);
        if read_only {
            avail_features |= 1 << VIRTIO_BLK_F_RO;
        }

        let mut config = [0u8; CONFIG_LEN];
        config[CONFIG_CAPACITY..CONFIG_CAPACITY + 8]
            .copy_from_slice(&capacity_sectors.to_le_bytes());
        config[CONFIG_SIZE_MAX..CONFIG_SIZE_MAX + 4].copy_from_slice(&SIZE_MAX.to_le_bytes());
        config[CONFIG_SEG_MAX..CONFIG_SEG_MAX + 4].copy_from_slice(&SEG_MAX.to_le_bytes());

        Ok(Self {
            disk: Disk {
                file,
                read_only,
                capacity_sectors,
                id: id_bytes,
                dirty: false,
                write_through: false,
                syncs: 0,
            },
            avail_features,
            acked_features: 0,
            config,
            queue_max_sizes: [QUEUE_SIZE],
            active: None,
        })
    }

    /// Disk size in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.disk.capacity_sectors
    }

    /// Features the driver acknowledged (0 before FEATURES_OK and after a reset).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }
}

/// The used length of a request whose data took the first `written` device-writable
/// bytes of its chain, the status byte the last (virtio 1.x, 2.7.8.2: the device wrote
/// at least the first `len` of them). The status counts when it follows the data,
/// that is when the data filled all the rest; otherwise (a failed read, an ID shorter
/// than its buffer) the bytes between were not written and only the data counts.
fn used_len(written: u32, descs: &[Descriptor]) -> u32 {
    let writable: u64 = descs
        .iter()
        .filter(|desc| desc.is_write_only())
        .map(|desc| u64::from(desc.len()))
        .sum();
    if u64::from(written) + 1 == writable {
        written.saturating_add(1)
    } else {
        written
    }
}

impl Disk {
    /// Handles one chain: its used length (see [`used_len`]) and what it cost the
    /// host beyond its bytes.
    fn handle_chain(&mut self, descs: &[Descriptor], memory: &GuestMemoryMmap) -> Served {
        let status_addr = match request::status_address(descs, memory) {
            Ok(addr) => addr,
            Err(e) => {
                guest_log::guest_warn!("virtio-blk: dropping a request: {e}");
                return Served::from(0);
            }
        };
        let synced_before = self.syncs;
        let (status, written) = match Request::parse(descs, memory, self.capacity_sectors) {
            Ok(req) => self.execute(&req, memory),
            Err(e) => {
                guest_log::guest_warn!("virtio-blk: malformed request: {e}");
                (VIRTIO_BLK_S_IOERR, 0)
            }
        };
        let extra_cost = SYNC_COST * (self.syncs - synced_before);
        // `status` is one of the VIRTIO_BLK_S_* values, all below 256.
        let used_len = match memory.write_obj(status as u8, status_addr) {
            Ok(()) => used_len(written, descs),
            Err(e) => {
                guest_log::guest_warn!(
                    "virtio-blk: cannot write the status byte at {status_addr:?}: {e}"
                );
                written
            }
        };
        Served {
            used_len,
            extra_cost,
        }
    }

    /// Runs a parsed request: returns the status and the data bytes written to guest
    /// memory.
    fn execute(&mut self, req: &Request, memory: &GuestMemoryMmap) -> (u32, u32) {
        let data_len = u32::try_from(req.data_len).unwrap_or(u32::MAX);
        let result = match req.request_type {
            RequestType::In => self.read(req, memory).map(|()| data_len),
            RequestType::Out => self.write(req, memory).map(|()| 0),
            RequestType::Flush => self.flush().map(|()| 0),
            RequestType::GetId => self.get_id(req, memory),
            RequestType::Unsupported(t) => {
                tracing::debug!("virtio-blk: unsupported request type {t}");
                return (VIRTIO_BLK_S_UNSUPP, 0);
            }
        };
        match result {
            Ok(written) => (VIRTIO_BLK_S_OK, written),
            Err(e) => {
                guest_log::guest_warn!("virtio-blk: {e}");
                (VIRTIO_BLK_S_IOERR, 0)
            }
        }
    }

    fn disk_offset(sector: u64) -> u64 {
        // Parsing checked sector * 512 + length against the capacity.
        sector.saturating_mul(SECTOR_SIZE)
    }

    fn read(&self, req: &Request, memory: &GuestMemoryMmap) -> Result<(), BlockError> {
        let mut file = FileAt {
            file: &self.file,
            offset: Self::disk_offset(req.sector),
        };
        for buf in &req.data {
            read_into_guest(memory, buf.addr, buf.len as usize, &mut file).map_err(|source| {
                BlockError::Io {
                    sector: req.sector,
                    source,
                }
            })?;
        }
        Ok(())
    }

    fn write(&mut self, req: &Request, memory: &GuestMemoryMmap) -> Result<(), BlockError> {
        if self.read_only {
            return Err(BlockError::ReadOnly { sector: req.sector });
        }
        // Before the first byte: a write that fails half-way has changed the file.
        self.dirty = true;
        let mut file = FileAt {
            file: &self.file,
            offset: Self::disk_offset(req.sector),
        };
        for buf in &req.data {
            write_from_guest(memory, buf.addr, buf.len as usize, &mut file).map_err(|source| {
                BlockError::Io {
                    sector: req.sector,
                    source,
                }
            })?;
        }
        if self.write_through {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes what was written durable; nothing to do when nothing was.
    fn flush(&mut self) -> Result<(), BlockError> {
        if !self.dirty {
            return Ok(());
        }
        self.syncs += 1;
        self.file.sync_data().map_err(BlockError::Flush)?;
        self.dirty = false;
        Ok(())
    }

    /// Copies the ID into the request's buffers, up to 20 bytes; returns the count.
    fn get_id(&self, req: &Request, memory: &GuestMemoryMmap) -> Result<u32, BlockError> {
        let mut remaining = &self.id[..req.id_len()];
        for buf in &req.data {
            if remaining.is_empty() {
                break;
            }
            let n = remaining.len().min(buf.len as usize);
            let (chunk, rest) = remaining.split_at(n);
            memory
                .write_slice(chunk, buf.addr)
                .map_err(|_| BlockError::IdWrite { addr: buf.addr.0 })?;
            remaining = rest;
        }
        // At most 20.
        Ok(req.id_len() as u32)
    }
}

/// A file seen from a moving position, read and written with pread/pwrite so the
/// file's own offset is never used (the file may be shared).
struct FileAt<'a> {
    file: &'a File,
    offset: u64,
}

impl FileAt<'_> {
    fn offset(&self) -> Result<libc::off_t, VolatileMemoryError> {
        libc::off_t::try_from(self.offset).map_err(|_| {
            VolatileMemoryError::IOError(std::io::Error::from_raw_os_error(libc::EINVAL))
        })
    }

    fn advance(&mut self, n: isize) -> Result<usize, VolatileMemoryError> {
        // A negative return was handled by the caller.
        let n = usize::try_from(n)
            .map_err(|_| VolatileMemoryError::IOError(std::io::Error::last_os_error()))?;
        self.offset = self.offset.saturating_add(n as u64);
        Ok(n)
    }
}

impl ReadVolatile for FileAt<'_> {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let offset = self.offset()?;
        let guard = buf.ptr_guard_mut();
        // SAFETY: the fd belongs to a live `File`; `guard` points at `buf.len()` bytes
        // of mapped guest memory that stay mapped while the guard lives, and pread
        // writes at most that many bytes there.
        let n = unsafe {
            libc::pread(
                self.file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                buf.len(),
                offset,
            )
        };
        if n < 0 {
            buf.bitmap().mark_dirty(0, buf.len());
            return Err(VolatileMemoryError::IOError(std::io::Error::last_os_error()));
        }
        let n = self.advance(n)?;
        buf.bitmap().mark_dirty(0, n);
        Ok(n)
    }
}

impl WriteVolatile for FileAt<'_> {
    fn write_volatile<B: BitmapSlice>(
        &mut self,
        buf: &VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let offset = self.offset()?;
        let guard = buf.ptr_guard();
        // SAFETY: the fd belongs to a live `File`; `guard` points at `buf.len()`
        // readable bytes of mapped guest memory, and pwrite only reads from them.
        let n = unsafe {
            libc::pwrite(
                self.file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                buf.len(),
                offset,
            )
        };
        if n < 0 {
            return Err(VolatileMemoryError::IOError(std::io::Error::last_os_error()));
        }
        self.advance(n)
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        DEVICE_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
        self.disk.write_through = self.acked_features & (1 << VIRTIO_BLK_F_FLUSH) == 0;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::devices::virtio::read_config_bytes(&self.config, offset, data);
    }

    // Nothing in the configuration space is writable (no CONFIG_WCE): writes are
    // ignored, the trait's default.

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        self.active = Some(ActiveQueue::new(memory, queues, interrupt)?);
        Ok(())
    }

    /// Every chain goes back as it is served.
    fn holds_chains(&self, _index: usize) -> bool {
        false
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        let disk = &mut self.disk;
        // A valid request has at most SEG_MAX + 2 = QUEUE_SIZE descriptors. A chain
        // that does not end within the queue's size (it loops; an indirect table,
        // which could hold more, is refused) never reaches the handler: see
        // ActiveQueue::serve.
        serve_single_queue(
            self.active.as_mut(),
            "virtio-blk",
            index,
            |descs, memory| disk.handle_chain(descs, memory),
        )
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use virtio_queue::QueueT;

    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    };
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const MEM_SIZE: u64 = 0x20_0000;
    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x11_0000;
    const STATUS: u64 = 0x1f_0000;
    const W: u16 = VRING_DESC_F_WRITE as u16;

    /// A temp file removed on drop.
    struct TempImage {
        path: std::path::PathBuf,
    }

    impl TempImage {
        fn new(len: usize) -> (Self, File) {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let path = std::env::temp_dir().join(format!(
                "vmm-blk-test-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::SeqCst)
            ));
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .unwrap();
            let contents: Vec<u8> = (0..len).map(|i| (i / SECTOR_SIZE as usize) as u8).collect();
            file.write_all(&contents).unwrap();
            (Self { path }, file)
        }
    }

    impl Drop for TempImage {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    fn memory() -> GuestMemoryMmap {
        // Two adjacent regions so buffers can cross a region boundary at 0x10_0000+0x8000.
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10_8000),
            (GuestAddress(0x10_8000), (MEM_SIZE - 0x10_8000) as usize),
        ])
        .unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
    }

    fn write_header(mem: &GuestMemoryMmap, request_type: u32, sector: u64) {
        let mut hdr = [0u8; 16];
        hdr[..4].copy_from_slice(&request_type.to_le_bytes());
        hdr[8..].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&hdr, GuestAddress(HDR)).unwrap();
    }

    struct Harness {
        _image: TempImage,
        image_path: std::path::PathBuf,
        block: Block,
        irq: Arc<EventFd>,
    }

    fn harness(sectors: usize, read_only: bool) -> Harness {
        let (image, file) = TempImage::new(sectors * SECTOR_SIZE as usize);
        let image_path = image.path.clone();
        let block = Block::new(file, read_only, "test-disk".into()).unwrap();
        Harness {
            _image: image,
            image_path,
            block,
            irq: Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()),
        }
    }

    impl Harness {
        fn image(&self) -> Vec<u8> {
            std::fs::read(&self.image_path).unwrap()
        }

        /// Activates the device on a queue holding `chains` and processes it; returns
        /// the used (id, len) entries.
        fn run(&mut self, mem: &GuestMemoryMmap, chains: &[RawDescriptor]) -> Vec<(u32, u32)> {
            let vq = MockSplitQueue::new(mem, 16);
            vq.add_desc_chains(chains, 0).unwrap();
            let queue: Queue = vq.create_queue().unwrap();
            self.block
                .activate(
                    mem.clone(),
                    vec![queue],
                    InterruptTrigger::new(self.irq.clone()),
                )
                .unwrap();
            assert_eq!(self.block.process_queue(0), QueueProgress::Done);
            let used_idx = vq.used().idx().load();
            (0..used_idx)
                .map(|i| {
                    let e = vq.used().ring().ref_at(i as usize).unwrap().load();
                    (e.id(), e.len())
                })
                .collect()
        }
    }

    /// header, data descriptors, status, linked, for descriptor table index 0.
    fn chain(data: &[(u64, u32, u16)]) -> Vec<RawDescriptor> {
        chain_at(0, data)
    }

    /// Like `chain`, for a chain stored from descriptor table index `first`.
    fn chain_at(first: u16, data: &[(u64, u32, u16)]) -> Vec<RawDescriptor> {
        let mut descs = vec![(HDR, 16u32, 0u16)];
        descs.extend_from_slice(data);
        descs.push((STATUS, 1, W));
        linked_at(first, &descs)
    }

    /// `descs` (address, length, flags) linked in order, from table index 0.
    fn linked(descs: &[(u64, u32, u16)]) -> Vec<RawDescriptor> {
        linked_at(0, descs)
    }

    fn linked_at(first: u16, descs: &[(u64, u32, u16)]) -> Vec<RawDescriptor> {
        let n = descs.len();
        descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                if i + 1 < n {
                    RawDescriptor::from(Descriptor::new(
                        addr,
                        len,
                        flags | VRING_DESC_F_NEXT as u16,
                        first + i as u16 + 1,
                    ))
                } else {
                    desc(addr, len, flags)
                }
            })
            .collect()
    }

    fn status(mem: &GuestMemoryMmap) -> u32 {
        u32::from(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
    }

    fn preset_status(mem: &GuestMemoryMmap) {
        mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    #[test]
    fn new_reports_capacity_features_and_config() {
        let h = harness(8, false);
        assert_eq!(h.block.capacity(), 8);
        let f = h.block.avail_features();
        assert_eq!(
            f,
            FEATURE_VERSION_1
                | FEATURE_EVENT_IDX
                | 1 << VIRTIO_BLK_F_FLUSH
                | 1 << VIRTIO_BLK_F_SEG_MAX
                | 1 << VIRTIO_BLK_F_SIZE_MAX
        );
        let mut cap = [0u8; 8];
        h.block.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 8);
        let mut seg = [0u8; 4];
        h.block.read_config(12, &mut seg);
        assert_eq!(u32::from_le_bytes(seg), 254);
        // Whole pages, and a request of SEG_MAX of them is not too large.
        let mut size_max = [0u8; 4];
        h.block.read_config(8, &mut size_max);
        let size_max = u32::from_le_bytes(size_max);
        assert_eq!(size_max % 4096, 0);
        assert!(size_max >= 4096);
        assert!(u64::from(size_max) * 254 <= super::super::request::MAX_REQUEST_BYTES);
        let mut beyond = [0xaa; 4];
        h.block.read_config(u64::MAX - 1, &mut beyond);
        assert_eq!(beyond, [0; 4]);

        let ro = harness(1, true);
        assert_ne!(ro.block.avail_features() & 1 << VIRTIO_BLK_F_RO, 0);

        let (_img, file) = TempImage::new(512);
        assert!(matches!(
            Block::new(file, false, "x".repeat(21)),
            Err(BlockError::IdTooLong { len: 21, .. })
        ));
    }

    #[test]
    fn read_fills_guest_memory_across_regions() {
        let mut h = harness(8, false);
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_IN, 2);
        preset_status(&mem);
        // 1024 bytes crossing the region boundary at 0x10_8000, then 512 more.
        let buf_a = 0x10_8000 - 0x200;
        let used = h.run(&mem, &chain(&[(buf_a, 1024, W), (DATA + 0x4000, 512, W)]));
        assert_eq!(used, vec![(0, 1024 + 512 + 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let mut got = vec![0u8; 1024];
        mem.read_slice(&mut got, GuestAddress(buf_a)).unwrap();
        assert!(got[..512].iter().all(|&b| b == 2));
        assert!(got[512..].iter().all(|&b| b == 3));
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA + 0x4000))
            .unwrap();
        assert!(got.iter().all(|&b| b == 4));
        assert_eq!(h.irq.read().unwrap(), 1);
    }

    #[test]
    fn write_updates_the_image() {
        let mut h = harness(8, false);
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_OUT, 5);
        preset_status(&mem);
        mem.write_slice(&[0x5a; 1024], GuestAddress(DATA)).unwrap();
        let used = h.run(&mem, &chain(&[(DATA, 1024, 0)]));
        assert_eq!(used, vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let image = h.image();
        assert!(image[5 * 512..7 * 512].iter().all(|&b| b == 0x5a));
        assert!(image[4 * 512..5 * 512].iter().all(|&b| b == 4));
        assert!(image[7 * 512..].iter().all(|&b| b == 7));
    }

    #[test]
    fn flush_and_get_id() {
        let mut h = harness(1, false);
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        preset_status(&mem);
        assert_eq!(h.run(&mem, &chain(&[])), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);

        let mut h = harness(1, false);
        write_header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        preset_status(&mem);
        mem.write_slice(&[0xff; 20], GuestAddress(DATA)).unwrap();
        assert_eq!(h.run(&mem, &chain(&[(DATA, 20, W)])), vec![(0, 21)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let mut id = [0u8; 20];
        mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..9], b"test-disk");
        assert!(id[9..].iter().all(|&b| b == 0));

        // A flush carrying data is malformed.
        let mut h = harness(1, false);
        write_header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(h.run(&mem, &chain(&[(DATA, 512, 0)])), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
    }

    /// Runs one request of `request_type` at sector 0 (a sector of data for a write)
    /// and checks it succeeded.
    fn run_ok(h: &mut Harness, mem: &GuestMemoryMmap, request_type: u32) {
        write_header(mem, request_type, 0);
        preset_status(mem);
        let data: &[(u64, u32, u16)] = if request_type == VIRTIO_BLK_T_OUT {
            &[(DATA, 512, 0)]
        } else {
            &[]
        };
        assert_eq!(h.run(mem, &chain(data)), vec![(0, 1)]);
        assert_eq!(status(mem), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn a_flush_syncs_the_disk_only_after_a_write() {
        let mem = memory();
        let mut h = harness(8, false);
        h.block.set_acked_features(h.block.avail_features());
        run_ok(&mut h, &mem, VIRTIO_BLK_T_FLUSH);
        assert_eq!(h.block.disk.syncs, 0);
        run_ok(&mut h, &mem, VIRTIO_BLK_T_OUT);
        assert_eq!(h.block.disk.syncs, 0, "a write-back cache syncs on flush");
        run_ok(&mut h, &mem, VIRTIO_BLK_T_FLUSH);
        run_ok(&mut h, &mem, VIRTIO_BLK_T_FLUSH);
        assert_eq!(h.block.disk.syncs, 1);

        let mut read_only = harness(8, true);
        read_only
            .block
            .set_acked_features(read_only.block.avail_features());
        run_ok(&mut read_only, &mem, VIRTIO_BLK_T_FLUSH);
        assert_eq!(read_only.block.disk.syncs, 0);
    }

    /// A driver that did not take VIRTIO_BLK_F_FLUSH never flushes: it was told the
    /// cache is write-through, so each write is durable before it completes.
    #[test]
    fn a_driver_without_flush_gets_each_write_synced() {
        let mem = memory();
        let mut h = harness(8, false);
        h.block.set_acked_features(FEATURE_VERSION_1);
        run_ok(&mut h, &mem, VIRTIO_BLK_T_OUT);
        run_ok(&mut h, &mem, VIRTIO_BLK_T_OUT);
        assert_eq!(h.block.disk.syncs, 2);

        h.block.reset();
        h.block.set_acked_features(h.block.avail_features());
        run_ok(&mut h, &mem, VIRTIO_BLK_T_OUT);
        assert_eq!(h.block.disk.syncs, 2);
    }

    #[test]
    fn unsupported_type() {
        let mut h = harness(1, false);
        let mem = memory();
        write_header(&mem, 11 /* DISCARD, not offered */, 0);
        preset_status(&mem);
        assert_eq!(h.run(&mem, &chain(&[(DATA, 16, 0)])), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_UNSUPP);
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let mut h = harness(4, true);
        let before = h.image();
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_OUT, 0);
        preset_status(&mem);
        mem.write_slice(&[0x5a; 512], GuestAddress(DATA)).unwrap();
        assert_eq!(h.run(&mem, &chain(&[(DATA, 512, 0)])), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        assert_eq!(h.image(), before);
        // Reads still work.
        let mut h2 = harness(4, true);
        write_header(&mem, VIRTIO_BLK_T_IN, 3);
        assert_eq!(h2.run(&mem, &chain(&[(DATA, 512, W)])), vec![(0, 513)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
    }

    /// One request must not move gigabytes while the event loop waits: a chain whose
    /// buffers (here one, the same memory listed twice) add up to more than
    /// MAX_REQUEST_BYTES is refused, whatever the disk's size.
    #[test]
    fn a_request_larger_than_the_limit_is_refused() {
        use super::super::request::{Request, RequestError, MAX_REQUEST_BYTES};
        let size = MAX_REQUEST_BYTES + 0x10_0000;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap();
        let half = u32::try_from(MAX_REQUEST_BYTES / 2).unwrap();
        let parse = |data: &[(u64, u32, u16)]| {
            write_header(&mem, VIRTIO_BLK_T_OUT, 0);
            let descs: Vec<Descriptor> = chain(data).into_iter().map(Descriptor::from).collect();
            Request::parse(&descs, &mem, u64::MAX / SECTOR_SIZE)
        };
        let at_limit = parse(&[(DATA, half, 0), (DATA, half, 0)]).unwrap();
        assert_eq!(at_limit.data_len, MAX_REQUEST_BYTES);
        let over = parse(&[(DATA, half, 0), (DATA, half, 0), (DATA, 512, 0)]);
        assert!(
            matches!(over, Err(RequestError::TooLarge { len }) if len == MAX_REQUEST_BYTES + 512),
            "{over:?}"
        );
    }

    #[test]
    fn requests_beyond_capacity_fail() {
        let mem = memory();
        for (sector, len) in [
            (8u64, 512u32),
            (7, 1024),
            (u64::MAX / 512, 512),
            (u64::MAX, 512),
        ] {
            for request_type in [VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT] {
                let mut h = harness(8, false);
                let before = h.image();
                write_header(&mem, request_type, sector);
                preset_status(&mem);
                // A failed read wrote nothing before its status byte: used length 0.
                let (flags, used) = if request_type == VIRTIO_BLK_T_IN {
                    (W, 0)
                } else {
                    (0, 1)
                };
                assert_eq!(h.run(&mem, &chain(&[(DATA, len, flags)])), vec![(0, used)]);
                assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR, "sector {sector}");
                assert_eq!(h.image(), before);
            }
        }
        // Length not a multiple of 512.
        let mut h = harness(8, false);
        write_header(&mem, VIRTIO_BLK_T_IN, 0);
        assert_eq!(h.run(&mem, &chain(&[(DATA, 100, W)])), vec![(0, 0)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        // The last sector is fine.
        let mut h = harness(8, false);
        write_header(&mem, VIRTIO_BLK_T_IN, 7);
        assert_eq!(h.run(&mem, &chain(&[(DATA, 512, W)])), vec![(0, 513)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn data_outside_memory_or_wrong_direction_fails() {
        let mem = memory();
        // The used length is 1 where the status is the only writable byte, else 0:
        // the writable data before it was not written.
        let cases: [(u32, u64, u32, u16, u32); 5] = [
            (VIRTIO_BLK_T_IN, MEM_SIZE, 512, W, 0),
            (VIRTIO_BLK_T_IN, MEM_SIZE - 256, 512, W, 0),
            (VIRTIO_BLK_T_IN, u64::MAX - 100, 512, W, 0),
            (VIRTIO_BLK_T_IN, DATA, 512, 0, 1),
            (VIRTIO_BLK_T_OUT, DATA, 512, W, 0),
        ];
        for (request_type, addr, len, flags, used) in cases {
            let mut h = harness(8, false);
            let before = h.image();
            write_header(&mem, request_type, 0);
            preset_status(&mem);
            assert_eq!(h.run(&mem, &chain(&[(addr, len, flags)])), vec![(0, used)]);
            assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR, "addr {addr:#x}");
            assert_eq!(h.image(), before);
        }
        // A good buffer followed by a bad one: nothing is read into the good one either.
        let mut h = harness(8, false);
        write_header(&mem, VIRTIO_BLK_T_IN, 0);
        mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
        let used = h.run(&mem, &chain(&[(DATA, 512, W), (MEM_SIZE, 512, W)]));
        assert_eq!(used, vec![(0, 0)]);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 0xee);
    }

    #[test]
    fn bad_header_fails() {
        let mem = memory();
        // Header too short / device-writable (the data before the status not written).
        for (len, flags) in [(8u32, 0u16), (16, W)] {
            let mut h = harness(8, false);
            write_header(&mem, VIRTIO_BLK_T_IN, 0);
            preset_status(&mem);
            let mut descs = chain(&[(DATA, 512, W)]);
            descs[0] = RawDescriptor::from(Descriptor::new(
                HDR,
                len,
                flags | VRING_DESC_F_NEXT as u16,
                1,
            ));
            assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
            assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        }
        // Header outside memory.
        let mut h = harness(8, false);
        preset_status(&mem);
        let descs = vec![
            RawDescriptor::from(Descriptor::new(MEM_SIZE, 16, VRING_DESC_F_NEXT as u16, 1)),
            desc(STATUS, 1, W),
        ];
        assert_eq!(h.run(&mem, &descs), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn chains_without_usable_status_are_dropped() {
        let mem = memory();
        let mut bad_status: Vec<Vec<RawDescriptor>> = Vec::new();
        // Status descriptor missing: the last descriptor is a read-only data buffer.
        bad_status.push(vec![
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            desc(DATA, 512, 0),
        ]);
        // Only a header.
        bad_status.push(vec![desc(HDR, 16, 0)]);
        // Status outside memory.
        let mut c = chain(&[(DATA, 512, W)]);
        c[2] = desc(MEM_SIZE, 1, W);
        bad_status.push(c);
        // A status descriptor of no bytes.
        let mut c = chain(&[(DATA, 512, W)]);
        c[2] = desc(STATUS, 0, W);
        bad_status.push(c);
        for descs in bad_status {
            let mut h = harness(8, false);
            write_header(&mem, VIRTIO_BLK_T_IN, 0);
            preset_status(&mem);
            mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
            assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
            assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), 0xff);
            assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 0xee);
        }
    }

    /// The same requests cut into descriptors otherwise than Linux does (virtio 1.x:
    /// the device assumes no layout).
    #[test]
    fn any_layout_of_a_request_works() {
        let mem = memory();
        let id_status = GuestAddress(DATA + 20);

        // A header split in two; the status after the data in one descriptor.
        let mut h = harness(8, false);
        write_header(&mem, VIRTIO_BLK_T_IN, 2);
        mem.write_obj(0xffu8, GuestAddress(DATA + 512)).unwrap();
        let descs = linked(&[(HDR, 8, 0), (HDR + 8, 8, 0), (DATA, 513, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 513)]);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA + 512)).unwrap(), 0);
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got.iter().all(|&b| b == 2));

        // The header and the data it precedes in one descriptor.
        let mut h = harness(8, false);
        write_header(&mem, VIRTIO_BLK_T_OUT, 5);
        preset_status(&mem);
        mem.write_slice(&[0x5a; 1024], GuestAddress(HDR + 16))
            .unwrap();
        let descs = linked(&[(HDR, 16 + 1024, 0), (STATUS, 1, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let image = h.image();
        assert!(image[5 * 512..7 * 512].iter().all(|&b| b == 0x5a));
        assert!(image[7 * 512..].iter().all(|&b| b == 7));

        // The ID and the status in one descriptor.
        let mut h = harness(1, false);
        write_header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        mem.write_obj(0xffu8, id_status).unwrap();
        let descs = linked(&[(HDR, 16, 0), (DATA, 21, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 21)]);
        assert_eq!(
            u32::from(mem.read_obj::<u8>(id_status).unwrap()),
            VIRTIO_BLK_S_OK
        );
        let mut id = [0u8; 9];
        mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"test-disk");

        // What a layout cannot change: a read's data is device-writable.
        let mut h = harness(8, false);
        let before = h.image();
        write_header(&mem, VIRTIO_BLK_T_IN, 0);
        preset_status(&mem);
        let descs = linked(&[(HDR, 16 + 512, 0), (STATUS, 1, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        assert_eq!(h.image(), before);
    }

    /// The used length counts the device-writable bytes written from the first one on
    /// (virtio 1.x, 2.7.8.2), the status byte only where it follows them: an ID
    /// shorter than its buffer leaves bytes unwritten before the status.
    #[test]
    fn the_used_length_is_the_writable_bytes_written_from_the_first() {
        let mem = memory();
        for (buffer, used) in [(10, 11), (20, 21), (30, 20), (512, 20)] {
            let mut h = harness(1, false);
            write_header(&mem, VIRTIO_BLK_T_GET_ID, 0);
            preset_status(&mem);
            mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
            let got = h.run(&mem, &chain(&[(DATA, buffer, W)]));
            assert_eq!(got, vec![(0, used)], "an ID buffer of {buffer} bytes");
            assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
            let id_len = buffer.min(20) as usize;
            let mut written = vec![0u8; buffer as usize];
            mem.read_slice(&mut written, GuestAddress(DATA)).unwrap();
            assert!(written[id_len..].iter().all(|&b| b == 0xee));
        }
        // The same with the status in the ID's descriptor.
        let mut h = harness(1, false);
        write_header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        let descs = linked(&[(HDR, 16, 0), (DATA, 31, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 20)]);
        // A read refused (past the disk's end) wrote nothing before its status.
        let mut h = harness(1, false);
        write_header(&mem, VIRTIO_BLK_T_IN, 0);
        let descs = chain(&[(DATA, 512, W), (DATA + 512, 512, W)]);
        assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn looping_and_overlong_chains_terminate() {
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_IN, 0);
        preset_status(&mem);
        // 0 -> 1 -> 2 -> 1 -> ... never ends.
        let descs = vec![
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(Descriptor::new(DATA, 512, W | VRING_DESC_F_NEXT as u16, 2)),
            RawDescriptor::from(Descriptor::new(STATUS, 1, W | VRING_DESC_F_NEXT as u16, 1)),
        ];
        let mut h = harness(8, false);
        assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), 0xff);

        // `next` pointing outside the descriptor table.
        let descs = vec![
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(Descriptor::new(
                STATUS,
                1,
                W | VRING_DESC_F_NEXT as u16,
                999,
            )),
        ];
        let mut h = harness(8, false);
        assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
    }

    /// A driver that did not negotiate VIRTIO_RING_F_INDIRECT_DESC (the device does
    /// not offer it) must not use an indirect table: a request through one, at the
    /// head or after direct descriptors, is refused whole, well-formed or not, with no
    /// I/O and a used length of 0 (its status byte lies in the table, not read).
    #[test]
    fn a_request_through_an_indirect_table_is_refused() {
        const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        const TABLE: u64 = 0x18_0000;
        let indirect_desc = 1u64 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
        assert_eq!(harness(1, false).block.avail_features() & indirect_desc, 0);
        let mem = memory();
        // Header, 512-byte buffers, status: 16 descriptors fit a queue of 16, 17 do not.
        for buffers in [1, 14, 15] {
            let data: Vec<(u64, u32, u16)> = (0..buffers).map(|_| (DATA, 512, W)).collect();
            let table = chain(&data);
            for (i, desc) in table.iter().enumerate() {
                mem.write_obj(*desc, GuestAddress(TABLE + 16 * i as u64))
                    .unwrap();
            }
            let whole_table = desc(TABLE, 16 * table.len() as u32, INDIRECT);
            // The header direct, the rest (from the table's second entry) indirect.
            let after_header = linked(&[(HDR, 16, 0), (TABLE + 16, 16 * buffers + 16, INDIRECT)]);
            for descs in [vec![whole_table], after_header] {
                write_header(&mem, VIRTIO_BLK_T_IN, 0);
                preset_status(&mem);
                mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
                let mut h = harness(16, false);
                assert_eq!(h.run(&mem, &descs), vec![(0, 0)], "{buffers} data buffers");
                assert_eq!(status(&mem), 0xff, "{buffers} data buffers");
                assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 0xee);
            }
        }
    }

    /// A chain that runs on past the queue's size (it can only loop) is refused whole,
    /// never served as the request its first descriptors make: here a complete write
    /// (header, 14 sectors, a status descriptor) whose last descriptor leads back to
    /// its first sector. Nothing is written to the disk, and there is no status byte
    /// to answer with (the chain has no last descriptor).
    #[test]
    fn a_chain_longer_than_the_queue_is_refused_whole() {
        let mem = memory();
        for request_type in [VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_IN] {
            let direction = if request_type == VIRTIO_BLK_T_OUT {
                0
            } else {
                W
            };
            let data: Vec<(u64, u32, u16)> = (0..14).map(|_| (DATA, 512, direction)).collect();
            let mut descs = chain(&data);
            descs[15] =
                RawDescriptor::from(Descriptor::new(STATUS, 1, W | VRING_DESC_F_NEXT as u16, 1));
            write_header(&mem, request_type, 0);
            preset_status(&mem);
            mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
            let mut h = harness(16, false);
            let before = h.image();
            assert_eq!(h.run(&mem, &descs), vec![(0, 0)]);
            assert_eq!(status(&mem), 0xff);
            assert_eq!(h.image(), before);
            assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 0xee);
        }
    }

    #[test]
    fn several_chains_and_reset() {
        let mut h = harness(8, false);
        let mem = memory();
        write_header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        // Two flushes sharing the header and status buffers.
        let mut descs = chain(&[]);
        descs.extend(chain_at(2, &[]));
        let used = h.run(&mem, &descs);
        assert_eq!(used, vec![(0, 1), (2, 1)]);
        h.block.reset();
        assert_eq!(h.block.acked_features(), 0);
        // Not active any more: notifications are ignored.
        assert_eq!(h.block.process_queue(0), QueueProgress::Done);
    }

    #[test]
    fn activation_checks_queues() {
        let mut h = harness(8, false);
        let mem = memory();
        let irq = InterruptTrigger::new(h.irq.clone());
        assert!(matches!(
            h.block.activate(mem.clone(), vec![], irq.clone()),
            Err(ActivateError::QueueCount {
                expected: 1,
                got: 0
            })
        ));
        let q = Queue::new(16).unwrap();
        assert!(matches!(
            h.block.activate(mem, vec![q], irq),
            Err(ActivateError::QueueNotReady { index: 0 })
        ));
    }

    #[test]
    fn file_at_reads_and_writes_at_offsets() {
        let (_img, mut file) = TempImage::new(2048);
        file.flush().unwrap();
        let mem = memory();
        let mut at = FileAt {
            file: &file,
            offset: 1024,
        };
        read_into_guest(&mem, GuestAddress(DATA), 512, &mut at).unwrap();
        assert_eq!(at.offset, 1536);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 2);
        // Past the end of the file: EOF is an error, not a short success.
        let mut at = FileAt {
            file: &file,
            offset: 2048,
        };
        assert!(read_into_guest(&mem, GuestAddress(DATA), 512, &mut at).is_err());
        // The file's own position is untouched.
        assert_eq!(file.stream_position().unwrap(), 2048);
    }
}
