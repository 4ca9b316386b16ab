//! `cargo bench -p vm-benches [-- --quick]`: boot time and memory overhead of our VMM
//! side by side with QEMU's microvm. See benches/README.md.

fn main() {
    std::process::exit(vm_benches::boot::main());
}
