//! `HostEdits` through the agent: batches on one connection, each answered.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_agent::client::connect_unix;
use guest_agent::host_edits::{GuestWrites, HostEditTarget};
use guest_agent::protocol::{
    encode_frame, AgentMessage, ClientMessage, EditKind, EditsShown, FrameReader, Hello, HostEdit,
    PROTOCOL_VERSION,
};
use guest_agent::server::{self, ListenAddr, ServerConfig};
use tokio::io::AsyncWriteExt;

fn set_old_mtime(path: &Path) {
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000))
        .unwrap();
}

fn mtime(path: &Path) -> i64 {
    std::fs::metadata(path).unwrap().mtime()
}

#[tokio::test]
async fn batches_of_host_edits_are_shown_on_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let share = dir.path().join("share");
    std::fs::create_dir(&share).unwrap();
    for name in ["host.js", "mine.js", "later.js"] {
        std::fs::write(share.join(name), name).unwrap();
        set_old_mtime(&share.join(name));
    }
    // The guest's write (this process stands for it) in a watched directory.
    let writes = GuestWrites::start().unwrap();
    writes.watch(&share);
    std::fs::write(share.join("mine.js"), "mine").unwrap();
    set_old_mtime(&share.join("mine.js"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !writes.wrote(&share.join("mine.js"), EditKind::Content, Instant::now()) {
        assert!(
            Instant::now() < deadline,
            "the guest's write was not recorded"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let socket = dir.path().join("agent.sock");
    let listener = server::Listener::bind(&ListenAddr::Unix(socket.clone())).unwrap();
    let config = ServerConfig {
        host_edits: Arc::new(HostEditTarget::new(vec![share.clone()], Some(writes))),
        ..Default::default()
    };
    tokio::spawn(server::serve(listener, config));

    let mut connection = connect_unix(&socket).await.unwrap();
    let first = connection
        .show_host_edits(vec![
            HostEdit::new(&share.join("host.js"), EditKind::Content),
            HostEdit::new(&share.join("mine.js"), EditKind::Content),
            HostEdit::new(&dir.path().join("agent.sock"), EditKind::Content),
        ])
        .await
        .unwrap();
    assert_eq!(
        first,
        EditsShown {
            shown: 1,
            guest_own: 1,
            failed: 1
        }
    );
    assert!(mtime(&share.join("host.js")) > 1_000_000_000);
    assert_eq!(mtime(&share.join("mine.js")), 1_000_000_000);
    // The same connection takes the next batch.
    let second = connection
        .show_host_edits(vec![HostEdit::new(
            &share.join("later.js"),
            EditKind::Content,
        )])
        .await
        .unwrap();
    assert_eq!(second.shown, 1);
    assert!(mtime(&share.join("later.js")) > 1_000_000_000);
}

#[tokio::test]
async fn another_request_after_host_edits_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let listener = server::Listener::bind(&ListenAddr::Unix(socket.clone())).unwrap();
    tokio::spawn(server::serve(listener, ServerConfig::default()));

    let stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let (r, mut w) = tokio::io::split(stream);
    let mut reader = FrameReader::new(r);
    let hello = ClientMessage::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        client: "test".into(),
        host_time_ns: None,
    });
    for message in [
        hello,
        ClientMessage::HostEdits(vec![HostEdit::new(
            Path::new("/nowhere"),
            EditKind::Entries,
        )]),
        ClientMessage::Health,
    ] {
        w.write_all(&encode_frame(&message).unwrap()).await.unwrap();
    }
    let mut answers = Vec::new();
    while let Some(answer) = reader.next::<AgentMessage>().await.unwrap() {
        answers.push(answer);
    }
    assert!(matches!(answers[0], AgentMessage::HelloOk { .. }));
    // Without writable shares nothing is touched: the edit is counted as failed.
    assert_eq!(
        answers[1],
        AgentMessage::EditsShown(EditsShown {
            shown: 0,
            guest_own: 0,
            failed: 1
        })
    );
    match &answers[2] {
        AgentMessage::Error { message } => assert!(message.contains("HostEdits"), "{message}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(answers.len(), 3);
    // An empty batch is answered too (the host may have dropped every path).
    let mut connection = connect_unix(&socket).await.unwrap();
    let empty = connection.show_host_edits(Vec::new()).await.unwrap();
    assert_eq!(empty, EditsShown::default());
}
