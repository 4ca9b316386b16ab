//! Command-line interface.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "vmctl",
    version,
    about = "Run coding agents in lightweight KVM virtual machines",
    long_about = "Run coding agents in lightweight KVM virtual machines.\n\n\
        Where this machine's /dev/kvm cannot boot a Linux guest (no kvm_intel/kvm_amd, \
        e.g. PVM), vmctl runs its VMM inside a QEMU-TCG nested host instead, and says so."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot a guest kernel with its serial console on stdout; exits 0 when the guest
    /// reboots or shuts down.
    Boot(BootArgs),
    /// Run a command inside a fresh QEMU-TCG nested host, which has a working
    /// /dev/kvm and sees this host's files read-only (for benchmarks and debugging).
    NestedExec(NestedExecArgs),
    /// Start the VM of a workspace (default: the current directory) and wait until
    /// its guest agent answers.
    Up(UpArgs),
    /// List workspace VMs.
    Ps,
    /// Shut down the VM of a workspace.
    Stop(WorkspaceArg),
    /// Shut down the VM of a workspace and remove its state.
    Rm(WorkspaceArg),
    /// Run a command in the VM of a workspace (starting it if needed), with stdio
    /// relayed; exits with the command's exit code (128+N for signal N).
    Exec(ExecArgs),
    /// An interactive login shell in the VM of a workspace.
    Shell(ShellArgs),
    /// One-shot: boot a throwaway VM for the workspace, run the command, tear it down.
    Run(ExecArgs),
    /// Guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    #[command(name = "__supervise", hide = true)]
    Supervise { dir: PathBuf },
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build (or find in the cache) a guest root image and print its path: the
    /// default one, or the one a recipe describes (see rootfs/README.md).
    Build {
        /// A recipe file (JSON: name, debian_packages, npm_packages, script).
        #[arg(long, value_name = "FILE")]
        recipe: Option<PathBuf>,
    },
}

/// Directory shares beyond the workspace itself; they apply when the VM starts.
#[derive(Debug, Default, clap::Args)]
pub struct MountArgs {
    /// Share a host directory with the VM, at GUEST (default: the same path),
    /// read-write unless ":ro" is given. Repeatable; more shares can be listed in
    /// ~/.config/vmctl/config.toml. The workspace itself is always shared read-write
    /// at its own path.
    #[arg(long = "mount", value_name = "HOST[:GUEST][:ro]")]
    pub mounts: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct ShellArgs {
    /// The workspace directory (default: the current directory).
    pub dir: Option<PathBuf>,
    #[command(flatten)]
    pub mounts: MountArgs,
}

#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// The workspace directory (default: the current directory).
    pub dir: Option<PathBuf>,
    #[command(flatten)]
    pub mounts: MountArgs,
    /// Boot the image built from this recipe (built first if needed; see
    /// `vmctl image build`) instead of the default image.
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct WorkspaceArg {
    /// The workspace directory (default: the current directory).
    pub dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// The workspace whose VM runs the command (default: the current directory).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// Run the command on a pseudo-terminal (the host terminal goes raw).
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Set an environment variable for the command. Repeatable.
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Run as this guest user ("root", or an account name); default: your host user.
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    #[command(flatten)]
    pub mounts: MountArgs,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

fn parse_env(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((key, val)) if !key.is_empty() => Ok((key.to_string(), val.to_string())),
        _ => Err(format!("expected K=V, got {value:?}")),
    }
}

#[derive(Debug, clap::Args)]
pub struct NestedExecArgs {
    /// vCPUs of the nested host.
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Memory of the nested host in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    pub memory: u64,
    /// A host directory the command may write to (shared read-write). Repeatable.
    #[arg(long = "writable", value_name = "DIR")]
    pub writable: Vec<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NestedMode {
    /// Nested host only where this machine's KVM cannot boot Linux.
    Auto,
    /// Always run through the QEMU-TCG nested host.
    Always,
    /// Never: use /dev/kvm directly, even if it cannot boot Linux.
    Never,
}

#[derive(Debug, clap::Args)]
pub struct BootArgs {
    /// Guest kernel (ELF vmlinux or bzImage). Default: the project's kernel, built
    /// on first use (kernel-config/build.sh).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk. Default without --kernel: the project's hello initramfs
    /// (rootfs/build-initramfs.sh); with --kernel: none.
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// Raw disk image, seen as /dev/vda, /dev/vdb, ... in the order given; append
    /// ":ro" to make it read-only. Repeatable.
    #[arg(long = "disk", value_name = "PATH[:ro]")]
    pub disks: Vec<String>,
    /// Extra kernel command-line arguments, appended to the defaults
    /// ("console=ttyS0 reboot=k panic=1 quiet" and the virtio-mmio devices).
    #[arg(
        long,
        value_name = "ARGS",
        default_value = "",
        hide_default_value = true
    )]
    pub cmdline: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = vmm::config::DEFAULT_VCPUS)]
    pub cpus: u32,
    /// Guest memory in MiB.
    #[arg(long, value_name = "MIB", default_value_t = vmm::config::DEFAULT_MEMORY_MIB)]
    pub memory: u64,
    /// Print how long the guest took to reach its init (it writes the boot timer).
    #[arg(long)]
    pub boot_time: bool,
    /// Whether to run the VMM inside the QEMU-TCG nested host.
    #[arg(long, value_enum, default_value_t = NestedMode::Auto)]
    pub nested: NestedMode,
}
