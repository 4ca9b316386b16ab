//! The guest agent: the guest's init helper that serves the host over vsock.
//!
//! Not written yet: the guest-agent issue builds it. Until then the test guests boot
//! a busybox initramfs (see `rootfs/`).

fn main() {
    eprintln!("guest-agent: not implemented yet (see the guest-agent issue)");
    std::process::exit(1);
}
