//! `vmctl bench [--quick] [ARGS...]`: runs the benchmark harness (`vm-bench`, the
//! same code as `cargo bench -p vm-benches`) against this vmctl.

use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot find vmctl's own path: {0}")]
    OwnPath(std::io::Error),
    #[error("no vm-bench beside {} and no source tree around it to build one from; build it with 'cargo build --release -p vm-benches --bin vm-bench'", .0.display())]
    NotFound(PathBuf),
    #[error("cannot run {what}: {source}")]
    Run {
        what: String,
        source: std::io::Error,
    },
}

/// Runs the harness and returns its exit code.
pub fn run(quick: bool, args: Vec<String>) -> Result<u8, BenchError> {
    let vmctl = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(BenchError::OwnPath)?;
    let mut harness_args: Vec<String> = Vec::new();
    if quick {
        harness_args.push("--quick".into());
    }
    harness_args.extend(["--vmctl".to_string(), vmctl.display().to_string()]);
    harness_args.extend(args);
    let mut command = harness_command(&vmctl)?;
    command.args(&harness_args);
    let what = format!("{command:?}");
    vmm::to_stderr!("vmctl: {what}");
    let status = command
        .status()
        .map_err(|source| BenchError::Run { what, source })?;
    Ok(status.code().map(|c| c.clamp(0, 255) as u8).unwrap_or(1))
}

/// `vm-bench` beside vmctl (both built in the same target directory), else
/// `cargo run` of it in the source tree vmctl was built in.
fn harness_command(vmctl: &Path) -> Result<Command, BenchError> {
    let beside = vmctl.with_file_name("vm-bench");
    if beside.is_file() {
        return Ok(Command::new(beside));
    }
    let tree = vmctl
        .ancestors()
        .find(|dir| dir.join("benches/Cargo.toml").is_file() && dir.join("Cargo.toml").is_file())
        .ok_or_else(|| BenchError::NotFound(vmctl.to_path_buf()))?;
    let mut command = Command::new("cargo");
    command.current_dir(tree).args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "vm-benches",
        "--bin",
        "vm-bench",
        "--",
    ]);
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_harness_beside_vmctl_wins_then_the_source_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path();
        std::fs::create_dir_all(tree.join("benches")).unwrap();
        std::fs::write(tree.join("Cargo.toml"), "").unwrap();
        std::fs::write(tree.join("benches/Cargo.toml"), "").unwrap();
        let release = tree.join("target/release");
        std::fs::create_dir_all(&release).unwrap();
        let vmctl = release.join("vmctl");
        let cargo = harness_command(&vmctl).unwrap();
        assert_eq!(cargo.get_program(), "cargo");
        assert_eq!(cargo.get_current_dir(), Some(tree));
        std::fs::write(release.join("vm-bench"), "").unwrap();
        assert_eq!(
            harness_command(&vmctl).unwrap().get_program(),
            release.join("vm-bench").as_os_str()
        );
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(harness_command(&elsewhere.path().join("vmctl")).is_err());
    }
}
