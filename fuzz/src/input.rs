//! The fuzzer's bytes, read as numbers and slices. Every input is valid: reading past
//! the end gives zeros and empty slices, so libFuzzer never wastes a run on a parse
//! error. [`Writer`] is the inverse, for hand-written seeds.

/// The most bytes one poke writes (its length is one byte).
pub const MAX_POKE: usize = u8::MAX as usize;

/// The most operations one input runs (each may notify a queue of hundreds of
/// requests).
pub const MAX_OPS: usize = 64;

pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (taken, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        taken
    }

    pub fn u8(&mut self) -> u8 {
        self.le::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.le())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.le())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.le())
    }

    /// What every harness's input ends with: the guest's memory image (its length,
    /// then its bytes), then up to [`MAX_OPS`] operations read by `read_op`.
    pub fn image_and_ops<Op>(&mut self, read_op: fn(&mut Reader<'a>) -> Op) -> (Vec<u8>, Vec<Op>) {
        let image_len = usize::from(self.u16());
        let image = self.bytes(image_len).to_vec();
        let mut ops = Vec::new();
        while !self.is_empty() && ops.len() < MAX_OPS {
            ops.push(read_op(self));
        }
        (image, ops)
    }

    /// A change to guest memory: an address in or near it
    /// ([`crate::guest::near_memory`]), then up to [`MAX_POKE`] bytes.
    pub fn poke(&mut self) -> (u32, Vec<u8>) {
        let addr = crate::guest::near_memory(self.u32());
        let len = usize::from(self.u8());
        (addr, self.bytes(len).to_vec())
    }

    fn le<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let taken = self.bytes(N);
        out[..taken.len()].copy_from_slice(taken);
        out
    }
}

#[derive(Default)]
pub struct Writer {
    pub data: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Writer {
        self.data.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Writer {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Writer {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Writer {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Writer {
        self.data.extend_from_slice(v);
        self
    }

    /// The inverse of [`Reader::image_and_ops`]'s image.
    pub fn image(&mut self, image: &[u8]) -> &mut Writer {
        self.u16(image.len() as u16).bytes(image)
    }

    /// The inverse of [`Reader::poke`].
    pub fn poke(&mut self, addr: u32, bytes: &[u8]) -> &mut Writer {
        self.u32(addr).u8(bytes.len() as u8).bytes(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_writer_writes_the_reader_reads_then_zeros() {
        let mut w = Writer::default();
        w.u8(1).u16(0x0203).u32(0x0405_0607).u64(8).bytes(b"xy");
        let mut r = Reader::new(&w.data);
        assert_eq!(
            (r.u8(), r.u16(), r.u32(), r.u64()),
            (1, 0x0203, 0x0405_0607, 8)
        );
        assert_eq!(r.bytes(5), b"xy");
        assert!(r.is_empty());
        assert_eq!((r.u32(), r.bytes(3)), (0, &[][..]));
    }
}
