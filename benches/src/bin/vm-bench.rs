//! The boot benchmark as a plain binary (same code as `cargo bench -p vm-benches`):
//! `cargo run --release -p vm-benches --bin vm-bench -- --quick`.

fn main() {
    std::process::exit(vm_benches::boot::main());
}
