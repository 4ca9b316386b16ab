//! Debugging client: `agent-ctl unix:PATH|hybrid:PATH:PORT health|ports|shutdown|exec ARGV...`
//! (exec forwards this process's stdin and prints output; exit code is the command's).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

use guest_agent::client::{connect_hybrid, connect_unix, Connection, ExecEvent};
use guest_agent::protocol::ExecRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The command's arguments need not be UTF-8.
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let text = |at: usize| args.get(at).and_then(|arg| arg.to_str());
    let (Some(target), Some(cmd)) = (text(0), text(1)) else {
        eprintln!("usage: agent-ctl unix:PATH|hybrid:PATH:PORT health|ports|shutdown|exec ARGV...");
        std::process::exit(2);
    };
    let conn: Connection = if let Some(p) = target.strip_prefix("unix:") {
        connect_unix(Path::new(p)).await?
    } else if let Some(rest) = target.strip_prefix("hybrid:") {
        let (p, port) = rest.rsplit_once(':').ok_or("hybrid:PATH:PORT")?;
        connect_hybrid(Path::new(p), port.parse()?).await?
    } else {
        return Err("target must be unix:PATH or hybrid:PATH:PORT".into());
    };
    match cmd {
        "health" => println!("{:#?}", conn.health().await?),
        "ports" => println!("{:#?}", conn.list_ports().await?),
        "shutdown" => conn.shutdown().await?,
        "exec" => {
            let req = ExecRequest {
                argv: args[2..].iter().cloned().map(OsString::into_vec).collect(),
                ..Default::default()
            };
            let (mut input, mut output) = conn.exec(req).await?.split();
            tokio::spawn(async move {
                let mut stdin = tokio::io::stdin();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match stdin.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if input.send_stdin(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                let _ = input.close_stdin().await;
                // Keep the connection open until the command exits.
                std::future::pending::<()>().await;
            });
            let (mut out, mut err) = (tokio::io::stdout(), tokio::io::stderr());
            while let Some(ev) = output.next_event().await? {
                match ev {
                    ExecEvent::Stdout(d) => out.write_all(&d).await?,
                    ExecEvent::Stderr(d) => err.write_all(&d).await?,
                    ExecEvent::Exited(st) => {
                        out.flush().await?;
                        std::process::exit(st.code.unwrap_or(128 + st.signal.unwrap_or(0)));
                    }
                }
            }
        }
        other => return Err(format!("unknown command {other}").into()),
    }
    Ok(())
}
