//! The benchmark's command line: its options, their defaults and `--help`.

use std::path::PathBuf;
use std::time::Duration;

use crate::report::BootConfig;
use crate::sections::Section;

use super::boot_configs;

pub(super) const USAGE: &str = "\
usage: cargo bench -p vm-benches -- [OPTIONS]
       vm-bench [OPTIONS]

Boots our VMM and QEMU's microvm side by side and reports boot time and memory,
and how many VMs each starts per second in a loop of create/destroy (and whether
the host's memory comes back after it); then measures the workspace VM (vmctl
up, exec through the guest agent), its shared workspace directory over
virtio-fs against the host, requests through its egress proxy against the same
requests from the host, and `vmctl agent claude --version` cold and warm with
the host memory of idle VMs.

  --quick              a smoke run (about 2 minutes in the nested host, far
                       less on hardware KVM; checks the harness, not the
                       numbers): 1 boot per VMM and configuration (default
                       10), 1 memory run (3); boots
                       with 1 vCPU/128 MiB and 2 vCPUs/1024 MiB only (default:
                       also 2/128 and 1/1024); 1 cold exec per configuration
                       (3); 1 vmctl up, 20 client and 3 CLI exec round trips
                       (5, 200, 20), no memory-given-back round (1);
                       virtio-fs 8 MiB and 100 files once;
                       egress: 10 requests per curl call and 2 downloads of
                       16 MiB per side (50, and 3 of 64 MiB); agent: 1 cold
                       and 3 warm runs (3, 10), 1 idle VM in the nested host
                       (3; 10 on hardware KVM, where memory allows); churn: 2
                       create/destroy cycles per VMM (100)
  --only SECTIONS      measure only these sections (comma-separated, or the
                       option repeated): boot (boot time, memory and cold exec
                       against QEMU), churn, workspace, fs (virtio-fs against
                       the host), egress, agent; default: all of them
  --runs N             boots per VMM
  --memory-runs N      memory-measuring boots per VMM
  --ready-runs N       vmctl up on fresh workspaces
  --cold-runs N        cold `vmctl exec` per boot configuration (default 3;
                       quick 1): to the agent's answer and the first output
  --exec-iterations N  round trips of `true` through the guest agent's Rust client
  --cli-iterations N   round trips of `vmctl exec -- true`
  --free-page-rounds N workspace: rounds of the memory given back after a burst
                       (two VMs each, with free page reporting and without; about
                       90 s a round; default 1, quick 0: not measured)
  --churn-cycles N     churn: create/destroy cycles per VMM
  --fs-mib N           virtio-fs: the sequential file's size in MiB (default 256
                       on hardware KVM, 64 in the nested host, 8 with --quick)
  --fs-files N         virtio-fs: small files created and stat-ed, and the git
                       repository's files (default 10000; nested 1000; quick 100)
  --fs-runs N          virtio-fs: repetitions per side (default 5 on hardware
                       KVM, 3 in the nested host; quick 1)
  --fs-edit-rounds N   virtio-fs: rounds of the host-edits probe per side (how
                       soon the host's edits reach the guest; default 10; quick 3)
  --fs-timeout SECS    virtio-fs: per script (default 600)
  --fs-cache POLICY    virtio-fs: the guest's caching, as vmctl's
                       VMCTL_VIRTIOFS_CACHE: auto (vmctl's default), never,
                       metadata or always, each optionally +writeback; to compare
                       them (only auto and never show host edits promptly)
  --out PATH           JSON report (default: target/bench/boot.json; Markdown next to it)
  --kernel PATH        guest kernel (default: kernel-config/build.sh guest)
  --initrd PATH        base initramfs (default: rootfs/build-initramfs.sh)
  --agent-initrd PATH  the workspace VM's agent initramfs
                       (default: guest-agent/build-initramfs.sh)
  --rootfs PATH        the workspace VM's root image (default: rootfs/build-rootfs.sh)
  --vmctl PATH         vmctl binary (default: $VMCTL_BIN or target/release/vmctl)
  --qemu PATH          QEMU binary (default: qemu-system-x86_64 from $PATH);
                       needed by boot and churn only (fs leaves out its
                       comparison by VMM without it)
  --cpus N             guest vCPUs: boot this one configuration only (default:
                       the matrix of 1 and 2 vCPUs, 128 and 1024 MiB)
  --memory MIB         guest memory: likewise (with one of --cpus/--memory, the
                       other is 1 vCPU or 128 MiB)
  --timeout SECS       per boot, to the marker and again to exit; per vmctl
                       command and exec round trip (default 60)
  --nested auto|always|never
                       measure inside the nested host: where KVM is not
                       hardware-backed (auto, default), always, or never
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Nested {
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone)]
pub(super) struct Args {
    pub(super) quick: bool,
    /// The sections to measure, in run order (`--only`; default: all).
    pub(super) sections: Vec<Section>,
    pub(super) runs: usize,
    pub(super) memory_runs: usize,
    pub(super) ready_runs: usize,
    /// Cold `vmctl exec` per boot configuration.
    pub(super) cold_runs: usize,
    pub(super) exec_iterations: usize,
    pub(super) cli_iterations: usize,
    /// `--free-page-rounds` as given (default: [`crate::workspace::MemoryReturnSizes`]).
    pub(super) free_page_rounds: Option<usize>,
    /// Churn: create/destroy cycles per VMM.
    pub(super) churn_cycles: usize,
    /// The virtio-fs sizes given on the command line (defaults: [`crate::fs::sizes`]).
    pub(super) fs_mib: Option<u64>,
    pub(super) fs_files: Option<u64>,
    pub(super) fs_runs: Option<usize>,
    pub(super) fs_edit_rounds: Option<usize>,
    pub(super) fs_timeout: Duration,
    /// `--fs-cache`: vmctl's VMCTL_VIRTIOFS_CACHE for the virtio-fs VM.
    pub(super) fs_cache: Option<String>,
    pub(super) out: Option<PathBuf>,
    pub(super) kernel: Option<PathBuf>,
    pub(super) initrd: Option<PathBuf>,
    pub(super) agent_initrd: Option<PathBuf>,
    pub(super) rootfs: Option<PathBuf>,
    pub(super) vmctl: Option<PathBuf>,
    pub(super) qemu: Option<PathBuf>,
    /// The first boot configuration's (also the memory runs' and churn's).
    pub(super) cpus: u32,
    pub(super) memory_mib: u64,
    /// What `--cpus` / `--memory` said (passed on to the nested run as given).
    pub(super) cpus_given: Option<u32>,
    pub(super) memory_given: Option<u64>,
    /// The boot figures' configurations; `configs[0]` is (`cpus`, `memory_mib`).
    pub(super) configs: Vec<BootConfig>,
    pub(super) timeout: Duration,
    pub(super) nested: Nested,
    /// Running inside the nested host: measure and write the report to this file.
    pub(super) inner: Option<PathBuf>,
}

pub(super) fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        sections: Vec::new(),
        runs: 0,
        memory_runs: 0,
        ready_runs: 0,
        cold_runs: 0,
        exec_iterations: 0,
        cli_iterations: 0,
        free_page_rounds: None,
        churn_cycles: 0,
        fs_mib: None,
        fs_files: None,
        fs_runs: None,
        fs_edit_rounds: None,
        fs_timeout: Duration::from_secs(600),
        fs_cache: None,
        out: None,
        kernel: None,
        initrd: None,
        agent_initrd: None,
        rootfs: None,
        vmctl: None,
        qemu: None,
        cpus: 1,
        memory_mib: 128,
        cpus_given: None,
        memory_given: None,
        configs: Vec::new(),
        timeout: Duration::from_secs(60),
        nested: Nested::Auto,
        inner: None,
    };
    let (mut runs, mut memory_runs) = (None, None);
    let (mut ready_runs, mut exec_iterations, mut cli_iterations) = (None, None, None);
    let mut cold_runs = None;
    let mut churn_cycles = None;
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n\n{USAGE}"))
        };
        let number = |name: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: not a number: {v:?}"))
        };
        match arg.as_str() {
            // cargo passes --bench to harness = false bench targets.
            "--bench" => {}
            "--quick" => a.quick = true,
            "--only" => crate::sections::add_named(&mut a.sections, &value("--only")?)?,
            "--runs" => runs = Some(number("--runs", value("--runs")?)? as usize),
            "--memory-runs" => {
                memory_runs = Some(number("--memory-runs", value("--memory-runs")?)? as usize)
            }
            "--ready-runs" => {
                ready_runs = Some(number("--ready-runs", value("--ready-runs")?)? as usize)
            }
            "--cold-runs" => {
                cold_runs = Some(number("--cold-runs", value("--cold-runs")?)? as usize)
            }
            "--exec-iterations" => {
                exec_iterations =
                    Some(number("--exec-iterations", value("--exec-iterations")?)? as usize)
            }
            "--cli-iterations" => {
                cli_iterations =
                    Some(number("--cli-iterations", value("--cli-iterations")?)? as usize)
            }
            "--free-page-rounds" => {
                a.free_page_rounds =
                    Some(number("--free-page-rounds", value("--free-page-rounds")?)? as usize)
            }
            "--churn-cycles" => {
                churn_cycles = Some(number("--churn-cycles", value("--churn-cycles")?)? as usize)
            }
            "--fs-mib" => a.fs_mib = Some(number("--fs-mib", value("--fs-mib")?)?),
            "--fs-files" => a.fs_files = Some(number("--fs-files", value("--fs-files")?)?),
            "--fs-runs" => a.fs_runs = Some(number("--fs-runs", value("--fs-runs")?)? as usize),
            "--fs-edit-rounds" => {
                a.fs_edit_rounds =
                    Some(number("--fs-edit-rounds", value("--fs-edit-rounds")?)? as usize)
            }
            "--fs-timeout" => {
                a.fs_timeout = Duration::from_secs(number("--fs-timeout", value("--fs-timeout")?)?)
            }
            "--fs-cache" => a.fs_cache = Some(value("--fs-cache")?),
            "--agent-initrd" => a.agent_initrd = Some(value("--agent-initrd")?.into()),
            "--rootfs" => a.rootfs = Some(value("--rootfs")?.into()),
            "--out" => a.out = Some(value("--out")?.into()),
            "--kernel" => a.kernel = Some(value("--kernel")?.into()),
            "--initrd" => a.initrd = Some(value("--initrd")?.into()),
            "--vmctl" => a.vmctl = Some(value("--vmctl")?.into()),
            "--qemu" => a.qemu = Some(value("--qemu")?.into()),
            "--cpus" => a.cpus_given = Some(number("--cpus", value("--cpus")?)? as u32),
            "--memory" => a.memory_given = Some(number("--memory", value("--memory")?)?),
            "--timeout" => {
                a.timeout = Duration::from_secs(number("--timeout", value("--timeout")?)?)
            }
            "--nested" => {
                a.nested = match value("--nested")?.as_str() {
                    "auto" => Nested::Auto,
                    "always" => Nested::Always,
                    "never" => Nested::Never,
                    v => {
                        return Err(format!(
                            "--nested: expected auto, always or never, not {v:?}"
                        ))
                    }
                }
            }
            "--inner" => a.inner = Some(value("--inner")?.into()),
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
    }
    if a.sections.is_empty() {
        a.sections = Section::ALL.to_vec();
    }
    a.runs = runs.unwrap_or(if a.quick { 1 } else { 10 });
    a.memory_runs = memory_runs.unwrap_or(if a.quick { 1 } else { 3 });
    a.ready_runs = ready_runs.unwrap_or(if a.quick { 1 } else { 5 });
    a.cold_runs = cold_runs.unwrap_or(if a.quick { 1 } else { 3 });
    a.exec_iterations = exec_iterations.unwrap_or(if a.quick { 20 } else { 200 });
    a.cli_iterations = cli_iterations.unwrap_or(if a.quick { 3 } else { 20 });
    a.churn_cycles = crate::churn::cycles(a.quick, churn_cycles);
    a.configs = boot_configs(a.quick, a.cpus_given, a.memory_given);
    (a.cpus, a.memory_mib) = (a.configs[0].vcpus, a.configs[0].memory_mib);
    if [
        a.runs,
        a.memory_runs,
        a.ready_runs,
        a.cold_runs,
        a.exec_iterations,
        a.cli_iterations,
        a.churn_cycles,
        a.cpus as usize,
        a.memory_mib as usize,
        a.fs_mib.unwrap_or(1) as usize,
        a.fs_files.unwrap_or(1) as usize,
        a.fs_runs.unwrap_or(1),
        a.fs_edit_rounds.unwrap_or(1),
        a.fs_timeout.as_secs() as usize,
    ]
    .contains(&0)
    {
        return Err(
            "--runs, --memory-runs, --ready-runs, --cold-runs, --exec-iterations, --cli-iterations, \
                    --churn-cycles, --cpus, --memory, --fs-mib, --fs-files, --fs-runs, \
                    --fs-edit-rounds and --fs-timeout must be at least 1"
                .into(),
        );
    }
    Ok(a)
}
