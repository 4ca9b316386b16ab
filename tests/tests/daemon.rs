//! The per-user daemon on the host alone (no VM): it goes away with its state
//! directory.

use std::process::Stdio;
use std::time::{Duration, Instant};
use vm_tests::Workspace;

#[test]
fn the_daemon_stops_once_its_state_directory_is_removed() {
    let ws = Workspace::new("daemon-state");
    let state = ws.state();
    let runtime = ws.path().with_file_name("run");
    std::fs::create_dir_all(&runtime).unwrap();
    // As a client leaves it: the daemon may be started before any VM.
    std::fs::create_dir_all(state.join("vmctl")).unwrap();
    let mut daemon = ws
        .command(&["daemon"])
        .env("XDG_RUNTIME_DIR", &runtime)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vmctl daemon");
    let socket_dir = runtime.join("vmctl");
    let listening = |deadline: Instant| loop {
        let has_socket = std::fs::read_dir(&socket_dir)
            .map(|entries| {
                entries
                    .flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "sock"))
            })
            .unwrap_or(false);
        if has_socket || Instant::now() > deadline {
            return has_socket;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        listening(Instant::now() + Duration::from_secs(20)),
        "the daemon did not bind its socket in {}",
        socket_dir.display()
    );
    // It stays while its state directory is there (two of its 5 s checks).
    std::thread::sleep(Duration::from_secs(11));
    assert!(
        daemon.try_wait().unwrap().is_none(),
        "the daemon stopped by itself while its state directory was there"
    );
    std::fs::remove_dir_all(&state).unwrap();
    // README: within 5 s (its check's period), given some room on a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = daemon.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = daemon.kill();
            panic!("the daemon outlived its removed state directory by 10 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = daemon.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(status.success(), "{status}: {said}");
    assert!(
        said.contains("was removed; nothing left to serve"),
        "{said}"
    );
}
