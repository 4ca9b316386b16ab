//! A minimal writer of uncompressed newc ("070701") cpio archives, enough to append
//! `/etc/vmtest.sh` to the project's initramfs (the kernel unpacks concatenated
//! archives). Same format as the VM tests' writer, kept here to stay self-contained.

/// One file or directory of the archive.
pub struct Entry<'a> {
    /// Path inside the archive, without a leading slash (`etc/vmtest.sh`).
    pub path: &'a str,
    /// Full mode, type bits included (`0o100755` file, `0o040755` directory).
    pub mode: u32,
    pub data: &'a [u8],
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn write_entry(out: &mut Vec<u8>, ino: u32, path: &str, mode: u32, nlink: u32, data: &[u8]) {
    // magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor,
    // rdevmajor, rdevminor, namesize, check: 8 hex digits each.
    let header = format!(
        "070701{ino:08x}{mode:08x}{z:08x}{z:08x}{nlink:08x}{z:08x}{size:08x}\
         {z:08x}{z:08x}{z:08x}{z:08x}{namesize:08x}{z:08x}",
        z = 0,
        size = data.len(),
        namesize = path.len() + 1,
    );
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(path.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

/// The archive, trailer included.
pub fn newc_archive(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let nlink = if e.mode & 0o170000 == 0o040000 { 2 } else { 1 };
        write_entry(&mut out, 1000 + i as u32, e.path, e.mode, nlink, e.data);
    }
    write_entry(&mut out, 0, "TRAILER!!!", 0, 1, &[]);
    out
}

/// `base` (the project's gzip'd initramfs) followed by an archive holding
/// `/etc/vmtest.sh` = `script`, which the guest's `/init` runs after the boot timer.
/// The appended archive must start 4-byte aligned; the kernel skips the zero padding.
pub fn initramfs_with_script(base: &[u8], script: &str) -> Vec<u8> {
    let mut image = base.to_vec();
    image.resize(image.len().div_ceil(512) * 512, 0);
    image.extend_from_slice(&newc_archive(&[
        Entry {
            path: "etc",
            mode: 0o040755,
            data: &[],
        },
        Entry {
            path: "etc/vmtest.sh",
            mode: 0o100755,
            data: script.as_bytes(),
        },
    ]));
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_newc_and_aligned() {
        let a = newc_archive(&[Entry {
            path: "etc/x",
            mode: 0o100644,
            data: b"hello",
        }]);
        assert!(a.starts_with(b"070701"));
        // 110-byte header + "etc/x\0" = 116, aligned; data 5 -> 124 (padded).
        assert_eq!(&a[110..116], b"etc/x\0");
        assert_eq!(&a[116..121], b"hello");
        assert_eq!(&a[124..130], b"070701");
        assert_eq!(a.len() % 4, 0);
        assert!(a.windows(10).any(|w| w == b"TRAILER!!!"));
        // namesize of the first entry: 6.
        assert_eq!(&a[94..102], b"00000006");
    }

    #[test]
    fn appended_archive_is_aligned() {
        let img = initramfs_with_script(&[1, 2, 3], "echo hi\n");
        assert_eq!(&img[..3], &[1, 2, 3]);
        assert_eq!(&img[512..518], b"070701");
    }
}
