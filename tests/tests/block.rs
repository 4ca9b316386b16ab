//! virtio-blk: a read-write and a read-only disk, checked from both sides.

use std::ffi::OsString;
use std::fs;
use vm_tests::{boot_script, guest_value, random_bytes, random_hex, vm_scenario, TempDir};

const IMAGE_SIZE: usize = 4 << 20;

#[test]
fn disks_read_write_and_read_only() {
    vm_scenario("block::disks_read_write_and_read_only", || {
        let dir = TempDir::new("block");
        let (a, b) = (dir.join("a.img"), dir.join("b.img"));

        let marker = random_hex(32);
        let mut a_data = vec![0u8; IMAGE_SIZE];
        a_data[..marker.len()].copy_from_slice(marker.as_bytes());
        fs::write(&a, &a_data).unwrap();
        let b_data = random_bytes(IMAGE_SIZE);
        fs::write(&b, &b_data).unwrap();

        let new_marker = random_hex(32);
        let script = format!(
            r#"echo "DISKS=$(cd /dev && echo vd*)"
echo "VDB_RO=$(cat /sys/block/vdb/ro 2>&1)"
echo "VDA_MARKER=$(dd if=/dev/vda bs=512 count=1 2>/dev/null | head -c {len})"
if printf '%s' {new_marker} | dd of=/dev/vda bs=512 seek=8 conv=notrunc,fsync 2>/dev/null; then
    echo VDA_WRITE=ok
else
    echo VDA_WRITE=failed
fi
if err=$(printf 'overwritten' | dd of=/dev/vdb bs=512 conv=notrunc,fsync 2>&1); then
    echo VDB_WRITE=succeeded
else
    echo VDB_WRITE=failed
    echo "VDB_ERROR=$(echo $err)"
fi
sync
"#,
            len = marker.len()
        );
        let disk_a = OsString::from(&a);
        let mut disk_b = OsString::from(&b);
        disk_b.push(":ro");
        let run = boot_script(
            &dir,
            &script,
            &[
                "--disk".as_ref(),
                disk_a.as_os_str(),
                "--disk".as_ref(),
                disk_b.as_os_str(),
            ],
        );
        let report = run.report();

        assert_eq!(
            guest_value(&run.stdout, "DISKS"),
            Some("vda vdb"),
            "{report}"
        );
        assert_eq!(
            guest_value(&run.stdout, "VDA_MARKER"),
            Some(marker.as_str()),
            "the guest did not read the marker from /dev/vda\n{report}"
        );
        assert_eq!(
            guest_value(&run.stdout, "VDA_WRITE"),
            Some("ok"),
            "{report}"
        );
        assert_eq!(
            guest_value(&run.stdout, "VDB_WRITE"),
            Some("failed"),
            "writing the read-only /dev/vdb must fail in the guest\n{report}"
        );

        let a_after = fs::read(&a).unwrap();
        assert_eq!(a_after.len(), IMAGE_SIZE, "a.img changed size");
        assert_eq!(
            &a_after[4096..4096 + new_marker.len()],
            new_marker.as_bytes(),
            "the guest's write to sector 8 of /dev/vda is not in a.img\n{report}"
        );
        assert_eq!(
            &a_after[..marker.len()],
            marker.as_bytes(),
            "a.img's first marker was clobbered"
        );
        assert!(
            a_after[marker.len()..4096].iter().all(|&x| x == 0)
                && a_after[4096 + new_marker.len()..].iter().all(|&x| x == 0),
            "the guest wrote outside the expected range of a.img"
        );
        assert!(
            fs::read(&b).unwrap() == b_data,
            "the read-only b.img was modified\n{report}"
        );
    });
}
