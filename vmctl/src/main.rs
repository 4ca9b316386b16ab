//! `vmctl`: the host CLI of the micro-VM runtime.

mod artifacts;
mod boot;
mod cli;
mod host_kvm;
mod nested;
mod terminal;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    init_logging();
    // The nested host's kernel starts us as its init with the job in the environment
    // (kernel arguments after `--` would hide QEMU's own device arguments).
    if let Some(job) = nested::init::job_from_environment() {
        return exit_with(nested::init::run(&job).map_err(|e| e.to_string()));
    }
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Boot(args) => boot::run(args).map_err(|e| e.to_string()),
        cli::Command::NestedExec(args) => {
            nested::launcher::run_command(args.command, args.cpus, args.memory, &args.writable)
                .map_err(|e| e.to_string())
        }
    };
    exit_with(result)
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VMCTL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn exit_with(result: Result<u8, String>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("vmctl: error: {e}");
            ExitCode::FAILURE
        }
    }
}
