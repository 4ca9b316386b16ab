//! `vmctl __supervise DIR`: the long-lived process behind a workspace VM, started
//! detached by `vmctl up`. It runs the VMM (directly, or in the nested host) with the
//! VM's vsock at `DIR/vsock.sock`, the guest console in `DIR/console.log`, and the
//! VM's network side ([`crate::network`]): the egress proxy, relays, published ports
//! and the control socket `DIR/control.sock`.

use std::path::Path;
use std::time::Instant;

use vmm::config::{DiskConfig, VmConfig, VsockConfig};

use crate::state::VmDir;

pub fn run(dir: &Path) -> Result<u8, String> {
    let vm = VmDir {
        path: dir.to_path_buf(),
    };
    let record = vm.read_record().map_err(|e| e.to_string())?;
    std::fs::write(vm.pid_file(), std::process::id().to_string())
        .map_err(|e| format!("{}: {e}", vm.pid_file().display()))?;

    let mut config = VmConfig::new(record.kernel.clone());
    config.initrd = Some(record.initrd.clone());
    config.disks = vec![DiskConfig {
        path: record.rootfs.clone(),
        read_only: true,
    }];
    config.extra_cmdline = record.agent_cmdline.clone();
    config.vcpus = record.cpus;
    config.memory_mib = record.memory_mib;
    config.vsock = Some(VsockConfig {
        guest_cid: vmm::devices::virtio::vsock::DEFAULT_GUEST_CID,
        uds_path: vm.vsock_socket(),
    });
    eprintln!(
        "vmctl: supervising the VM of {}",
        record.workspace.display()
    );
    vm.create_sockets_dir().map_err(|e| e.to_string())?;
    // Without its network side the VM would boot without a way out; better not boot.
    crate::network::services::start(&vm, &record)
        .map_err(|e| format!("cannot serve the VM's network: {e}"))?;
    if let Some(file) = record.shares.as_ref().and_then(|s| s.failure_file.as_ref()) {
        let _ = std::fs::remove_file(file);
    }
    let outcome = if record.nested {
        crate::nested::launcher::run_vm(&config, record.shares.as_ref(), false)
            .map_err(|e| e.to_string())
    } else {
        crate::boot::run_vmm_sharing(
            &config,
            record.shares.as_ref(),
            &vm.sockets_dir(),
            false,
            Instant::now(),
        )
        .map_err(|e| e.to_string())
    };
    eprintln!("vmctl: the VM ended: {outcome:?}");
    let _ = std::fs::remove_file(vm.pid_file());
    for socket in [
        vm.vsock_socket(),
        vm.control_socket(),
        crate::network::services::service_socket(&vm.vsock_socket()),
    ] {
        let _ = std::fs::remove_file(socket);
    }
    if vm.sockets_dir() != vm.path {
        let _ = std::fs::remove_dir(vm.sockets_dir());
    }
    outcome
}
