//! Writes the hand-written sessions as libFuzzer's seed corpus:
//! `fuzz-seeds DIR` makes `DIR/<target>/<name>` for each.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fuzz-seeds DIR (writes DIR/<target>/<session>)");
        return ExitCode::from(2);
    };
    for (target, name, data) in vmm_fuzz::seeds::corpus() {
        let target_dir = dir.join(target);
        let path = target_dir.join(name);
        let written =
            std::fs::create_dir_all(&target_dir).and_then(|()| std::fs::write(&path, data));
        if let Err(e) = written {
            eprintln!("fuzz-seeds: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
