//! `exec_loop SOCKET N`: N round trips of `true` through a workspace VM's agent
//! (its hybrid vsock socket), back to back, as `vm-bench` times them. Prints its
//! progress and every failure; exits 1 if any round trip failed. The load that
//! reproduces the nested host's known problem (see `scripts/exec-stress`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use vm_benches::workspace::exec_true;
use vm_tests::hang_report::last_console_lines;

/// One round trip takes milliseconds; a minute means the VM is gone or stuck.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(60);
/// After this many failures in a row the VM is gone: stop.
const MAX_FAILURES_IN_A_ROW: usize = 3;
/// Lines of the guest console shown with a failure: the agent's log of the last
/// commands it started and ended tells a request that never reached it from an
/// answer that never came back.
const CONSOLE_LINES: usize = 6;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (socket, count) = match args.as_slice() {
        [socket, n] => match n.parse::<usize>() {
            Ok(n) if n > 0 => (PathBuf::from(socket), n),
            _ => return usage(&format!("N must be a positive number, not {n:?}")),
        },
        _ => return usage("expected two arguments"),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("exec_loop: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let (mut failures, mut in_a_row) = (0, 0);
    for i in 1..=count {
        let result = runtime.block_on(async {
            tokio::time::timeout(ROUND_TRIP_LIMIT, exec_true(&socket))
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {ROUND_TRIP_LIMIT:?}")))
        });
        match result {
            Ok(()) => in_a_row = 0,
            Err(e) => {
                failures += 1;
                in_a_row += 1;
                eprintln!(
                    "exec_loop: round trip {i}/{count} failed after {:.1} s: {e}",
                    start.elapsed().as_secs_f64()
                );
                eprint!("exec_loop: {}", console_tail(&socket));
                if in_a_row == MAX_FAILURES_IN_A_ROW {
                    eprintln!("exec_loop: {in_a_row} failures in a row: stopping");
                    break;
                }
            }
        }
        if i % 250 == 0 {
            eprintln!(
                "exec_loop: {i}/{count} round trips in {:.1} s",
                start.elapsed().as_secs_f64()
            );
        }
    }
    eprintln!(
        "exec_loop: {failures} failed round trip(s) in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The last lines of the console of the VM whose vsock socket is `socket`
/// (`vms/<name>/vsock/vsock.sock`, its console `vms/<name>/console.log`).
fn console_tail(socket: &Path) -> String {
    match socket.parent().and_then(Path::parent) {
        Some(vm_dir) => last_console_lines(&vm_dir.join("console.log"), CONSOLE_LINES),
        None => "no console beside the socket\n".into(),
    }
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("exec_loop: {problem}\nusage: exec_loop SOCKET N (a workspace VM's vsock.sock)");
    ExitCode::from(2)
}
